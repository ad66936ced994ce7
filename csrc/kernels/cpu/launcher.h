// CPU multi-tensor launcher: lists of tensors -> (tensor, chunk) work items ->
// one at::parallel_for over all items, each thread running the item function
// of the CPU capability picked at start-up (see [Note: CPU capabilities]).
//
// [Note: chunking]
// Every tensor is cut into chunks of kChunkElems elements; the chunks of all
// tensors form one flat list of work items that a single parallel region
// splits between threads. A 4M-element embedding and 300 bias vectors thus
// balance across threads, and small tensors cost no parallel region each.
// 64K elements (256 KiB of fp32) keeps per-item overhead under 0.1% while
// giving enough items to balance a few large tensors over many cores.
//
// This header is compiled with the baseline flags only; the per-element code
// is in simd/ (see [Note: vectorisation and FMA] in simd/vec_io.h).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "kernels/cpu/items.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

namespace mixprec::kernels::cpu {

// Items for tensors of the given sizes, in list order (empty tensors: none).
std::vector<WorkItem> make_items(const std::vector<int64_t>& numels, int64_t* total);

// lists[k][i] is tensor i of list k; a list may be empty (slot left null).
template <int N>
Plan<N> make_plan(const std::array<const std::vector<at::Tensor>*, N>& lists) {
  Plan<N> plan;
  const auto& first = *lists[0];
  plan.slots.resize(first.size());
  std::vector<int64_t> numels(first.size());
  for (size_t i = 0; i < first.size(); ++i) {
    numels[i] = first[i].numel();
    for (int k = 0; k < N; ++k) {
      if (!lists[k]->empty()) {
        const at::Tensor& t = (*lists[k])[i];
        plan.slots[i][k] = Slot{t.data_ptr(), t.scalar_type()};
      }
    }
  }
  plan.items = make_items(numels, &plan.total);
  return plan;
}

// Runs body(first_item, last_item) over all items in one parallel region. The
// grain keeps ~32K elements per task so tiny workloads stay on one thread.
template <class Body>
void parallel_items(const std::vector<WorkItem>& items, int64_t total, const Body& body) {
  if (items.empty()) return;
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t grain = std::max<int64_t>(1, (n * 32768) / std::max<int64_t>(total, 1));
  if (grain >= n) {
    body(int64_t{0}, n);  // one task: no parallel region at all
    return;
  }
  at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) { body(b, e); });
}

}  // namespace mixprec::kernels::cpu
