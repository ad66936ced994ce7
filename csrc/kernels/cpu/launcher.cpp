#include "kernels/cpu/launcher.h"  // first: see [Note: vectorisation and FMA]

namespace mixprec::kernels::cpu {

std::vector<WorkItem> make_items(const std::vector<int64_t>& numels, int64_t* total) {
  std::vector<WorkItem> items;
  int64_t n_items = 0;
  *total = 0;
  for (int64_t n : numels) {
    n_items += (n + kChunkElems - 1) / kChunkElems;
    *total += n;
  }
  items.reserve(n_items);
  for (size_t t = 0; t < numels.size(); ++t) {
    for (int64_t b = 0; b < numels[t]; b += kChunkElems) {
      items.push_back(WorkItem{static_cast<int64_t>(t), b, std::min(numels[t], b + kChunkElems)});
    }
  }
  return items;
}

bool cpu_has_avx2_fma() {
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}

}  // namespace mixprec::kernels::cpu
