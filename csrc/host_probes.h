// host_probes.h: the host entry points for the CPU tests (host_probes.cpp says what they are).
#pragma once
#include <pybind11/pybind11.h>

namespace sinkattn {
void register_host_probes(pybind11::module_& m);
}
