// ZeRO stages as policies over the sharding core (core.h).
//
//   stage 1: optimizer state + fp32 masters sharded; full fp32 gradients stay on every
//            rank until the step, then one ordered reduce-scatter of all buckets.
//   stage 2: + gradients sharded: each bucket is reduce-scattered as soon as it is full
//            during backward and the full-size bucket is released afterwards.
// Stage 3 (parameters sharded, gathered per unit around forward/backward) is not built
// on this core yet; the Python engine refuses it with the list of what is missing.
#pragma once

#include "engines/sharded/core.h"

#include <cstdint>
#include <string>

namespace mixprec::engines::sharded {

// Core options for ZeRO `stage` (1 or 2). `collective`: "reduce_scatter", "allreduce",
// or "auto" (all-reduce + slice on Gloo, where it measured faster; reduce-scatter elsewhere).
CoreOptions zero_options(int64_t stage, int64_t bucket_cap_bytes, int64_t first_bucket_cap_bytes,
                         const std::string& collective, const std::string& group_name);

}  // namespace mixprec::engines::sharded
