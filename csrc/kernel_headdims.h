// kernel_headdims.h: which kernel head dims serve a call, for the extension's host code (api.cpp and
// host_probes.cpp). The list is build_info.h's kKernelHeadDims; a call runs on the smallest one that holds its head
// dim (the kernels pad the rest), and a tile table serves the head dims it specializes (each table declares
// `template <int kHeadDim> struct X;` and defines X<H> for the head dims it has). A header of its own, not
// build_info.h, so the host code can change without touching a header every kernel unit includes.
#pragma once
#include <cstddef>
#include <iterator>
#include <type_traits>
#include <utility>
#include <vector>

#include "build_info.h"

namespace sinkattn {

// The smallest kernel head dim >= d, or 0 when none holds d.
constexpr int served_headdim(int d) {
  for (int h : kKernelHeadDims)
    if (d <= h) return h;
  return 0;
}

// Whether the tile table Table defines Table<H> (sizeof of the declared-only primary template fails substitution).
template <template <int> class Table, int H, class = void>
struct TableHas : std::false_type {};
template <template <int> class Table, int H>
struct TableHas<Table, H, std::void_t<decltype(sizeof(Table<H>))>> : std::true_type {};

// f.template operator()<H>() for each kernel head dim H that Table defines, in kKernelHeadDims order.
template <template <int> class Table, class F, std::size_t... I>
void for_each_table_headdim(F&& f, std::index_sequence<I...>) {
  auto one = [&]<int H>() {
    if constexpr (TableHas<Table, H>::value) f.template operator()<H>();
  };
  (one.template operator()<kKernelHeadDims[I]>(), ...);
}
template <template <int> class Table, class F>
void for_each_table_headdim(F&& f) {
  for_each_table_headdim<Table>(f, std::make_index_sequence<std::size(kKernelHeadDims)>{});
}

// The kernel head dims Table defines.
template <template <int> class Table>
std::vector<int> table_headdims() {
  std::vector<int> hds;
  for_each_table_headdim<Table>([&]<int H>() { hds.push_back(H); });
  return hds;
}

}  // namespace sinkattn
