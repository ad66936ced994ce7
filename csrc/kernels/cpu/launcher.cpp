#include "kernels/cpu/launcher.h"

#include <atomic>
#include <cctype>
#include <cstdlib>
#include <string>

namespace mixprec::kernels::cpu {

namespace {
std::atomic<int64_t> regions{0};
}  // namespace

int64_t parallel_tasks(int64_t n_items, int64_t total, int64_t bytes, int64_t threads) {
  if (threads <= 1 || n_items <= 1 || bytes < kParallelMinBytes) return 1;
  // Items per task for kGrainElems elements (items hold up to kChunkElems each).
  const int64_t grain = std::max<int64_t>(1, (n_items * kGrainElems) / std::max<int64_t>(total, 1));
  return std::min(threads, (n_items + grain - 1) / grain);
}

void count_parallel_region() { regions.fetch_add(1, std::memory_order_relaxed); }

int64_t parallel_regions() { return regions.load(std::memory_order_relaxed); }

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

namespace {

#define MIXPREC_ITEM_FNS(CAP) \
  ItemFns { #CAP, &CAP::adam_items, &CAP::sgd_items, &CAP::unscale_items, &CAP::sumsq_items, &CAP::copy_items, \
         &CAP::scale_copy_items }

enum class Cap { kDefault = 0, kAvx2 = 1, kAvx512 = 2 };

// The widest capability this CPU (and OS) runs.
Cap cpu_capability() {
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("fma")) {
    return Cap::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return Cap::kAvx2;
  }
#endif
  return Cap::kDefault;
}

// MIXPREC_CPU_CAPABILITY, else ATEN_CPU_CAPABILITY: an upper bound (as in ATen).
Cap env_cap(Cap hw) {
  const char* v = std::getenv("MIXPREC_CPU_CAPABILITY");
  if (v == nullptr || *v == '\0') v = std::getenv("ATEN_CPU_CAPABILITY");
  if (v == nullptr) return hw;
  std::string s(v);
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  Cap want = hw;
  if (s == "default") want = Cap::kDefault;
  else if (s == "avx2") want = Cap::kAvx2;
  else if (s == "avx512") want = Cap::kAvx512;
  return static_cast<int>(want) < static_cast<int>(hw) ? want : hw;
}

ItemFns pick() {
  const Cap cap = env_cap(cpu_capability());
  (void)cap;
#if MIXPREC_CPU_AVX512
  if (cap == Cap::kAvx512) return MIXPREC_ITEM_FNS(AVX512);
#endif
#if MIXPREC_CPU_AVX2
  if (cap >= Cap::kAvx2) return MIXPREC_ITEM_FNS(AVX2);
#endif
  return MIXPREC_ITEM_FNS(DEFAULT);
}

}  // namespace

const ItemFns& item_fns() {
  static const ItemFns fns = pick();
  return fns;
}

}  // namespace mixprec::kernels::cpu
