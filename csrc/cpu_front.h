// cpu_front.h: the CPU front end's functions for the extension module (cpu_front.cpp says what it serves).
#pragma once
#include <pybind11/pybind11.h>

namespace sinkattn::cpu_front {
void register_functions(pybind11::module_& m);
}
