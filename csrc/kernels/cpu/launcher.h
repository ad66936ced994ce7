// CPU multi-tensor launcher: lists of tensors -> (tensor, chunk) work items ->
// one call of the item function over all items, inline or in one at::parallel_for,
// each thread running the item function of the CPU capability picked at start-up
// (see [Note: CPU capabilities]).
//
// [Note: chunking]
// Every tensor is cut into chunks of kChunkElems elements; the chunks of all
// tensors form one flat list of work items that a single parallel region
// splits between threads. A 4M-element embedding and 300 bias vectors thus
// balance across threads, and small tensors cost no parallel region each.
// 64K elements (256 KiB of fp32) keeps per-item overhead under 0.1% while
// giving enough items to balance a few large tensors over many cores. Items
// are the same whichever thread runs them, and so are their per-item results
// (partial sums, non-finite flags): no result depends on the split.
//
// [Note: inline below the parallel threshold]
// A parallel region is a fork/join: at::parallel_for (OpenMP in torch's CPU
// builds) hands work to every thread of the team and returns only when all of
// them have passed the region's closing barrier. A thread whose core is busy
// with another process, or whose (virtual) CPU went idle while the thread slept
// between calls (libgomp's threads sleep after a short spin), joins a scheduler
// time slice later: milliseconds, however small the call. ATen's own rule, a
// region once a loop has more than at::internal::GRAIN_SIZE = 32768 elements,
// bounds the cost of the fork on an idle machine (microseconds), not that wait;
// and a multi-tensor call adds its tensors up, so 4 gradients of 16K elements
// (65,536 in all) opened a region where torch's per-tensor foreach ops run each
// tensor inline. On the 2-vCPU development VM l2_norm of those took a median
// 7 ms per call at 2 threads with the calls 30 ms apart and 48 ms with 4 busy
// processes running, against 2-3 us inline; torch's own add on one 65,536-element
// tensor took 6-13 ms when spaced so (issue #38; benchmarks/bench_small_kernels.py).
// So a call opens a region only when the bytes it moves (each list's elements
// times Plan::passes at their dtype's size) reach kParallelMinBytes = 128 MiB:
// 2.7-9 ms of one thread at 50-15 GB/s, one or two time slices (HZ=250: 4 ms).
// Below that the call runs inline on the calling thread at any thread count and
// under any load; the AdamW step over 1,536 small tensors of 2M parameters
// (57 MB) is below it. Above it a lost slice can at most about double the call,
// while an idle machine splits it as before (tasks of at least kGrainElems
// elements, at most one per thread).
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

// [Note: inline below the parallel threshold]
constexpr int64_t kParallelMinBytes = int64_t{128} << 20;
constexpr int64_t kGrainElems = 32768;  // at::internal::GRAIN_SIZE

// lists[k][i] is tensor i of list k; a list may be empty (slot left null).
// passes[k]: see Plan::passes.
template <int N>
Plan<N> make_plan(const std::array<const std::vector<at::Tensor>*, N>& lists,
                  const std::array<int, N>& passes) {
  Plan<N> plan;
  plan.passes = passes;
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

// The bytes a plan moves: every element of list k, passes[k] times, at the size of
// its tensor's dtype (lists left empty: nothing).
template <int N>
int64_t plan_bytes(const Plan<N>& plan) {
  std::vector<int64_t> per_elem(plan.slots.size(), 0);
  for (size_t i = 0; i < plan.slots.size(); ++i) {
    for (int k = 0; k < N; ++k) {
      const Slot& s = plan.slots[i][k];
      if (s.ptr != nullptr) {
        per_elem[i] += plan.passes[k] * static_cast<int64_t>(c10::elementSize(s.dtype));
      }
    }
  }
  int64_t bytes = 0;
  for (const WorkItem& it : plan.items) bytes += (it.end - it.begin) * per_elem[it.tensor];
  return bytes;
}

// How many tasks a call moving `bytes` over n_items items (total elements) runs
// as with `threads` threads: 1 (inline on the calling thread) below
// kParallelMinBytes, else one per thread, each of at least kGrainElems elements.
int64_t parallel_tasks(int64_t n_items, int64_t total, int64_t bytes, int64_t threads);

// Counts the parallel regions the launcher opens (diagnostics; tests).
void count_parallel_region();
int64_t parallel_regions();

// Runs body(first_item, last_item) over all items of the plan: inline, or split
// into parallel_tasks() tasks by one at::parallel_for.
template <int N, class Body>
void parallel_items(const Plan<N>& plan, const Body& body) {
  const int64_t n = static_cast<int64_t>(plan.items.size());
  if (n == 0) return;
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const int64_t tasks =
      threads > 1 ? parallel_tasks(n, plan.total, plan_bytes(plan), threads) : 1;
  if (tasks <= 1) {
    body(int64_t{0}, n);  // no parallel region at all
    return;
  }
  count_parallel_region();
  // at::parallel_for (OpenMP) runs min(threads, ceil(n / grain)) chunks of ceil(n / that).
  at::parallel_for(0, n, (n + tasks - 1) / tasks, [&](int64_t b, int64_t e) { body(b, e); });
}

}  // namespace mixprec::kernels::cpu
