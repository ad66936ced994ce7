// ZeRO stages as policies over the sharding core (core.h).
//
//   stage 1: optimizer state + fp32 masters sharded; full fp32 gradients stay on every
//            rank until the step, then one ordered reduce-scatter of all buckets, each
//            bucket freed as its owned slice is folded into the gradient shard.
//   stage 2: + gradients sharded: each bucket is reduce-scattered as soon as it is full
//            during backward and completed (folded into the shard, the full-size bucket
//            released) while backward goes on, at most max_inflight_buckets in flight.
//   stage 3: + parameters sharded: one core per unit (src/mixprec/engines/units.py),
//            its flat parameter buffers freed between uses and all-gathered around the
//            unit's forward and backward ([Note: parameter sharding] in core.h). FSDP
//            (backend="fsdp") is stage 3 with FSDP2's configuration names.
#pragma once

#include "engines/sharded/core.h"

#include <cstdint>
#include <string>

namespace mixprec::engines::sharded {

// Core options for ZeRO `stage` (1, 2 or 3). `collective`: "reduce_scatter", "allreduce",
// or "auto" (all-reduce + slice on Gloo, where it measured faster; reduce-scatter elsewhere).
// `max_inflight_buckets`: [Note: bounded gradient memory] in core.h (stages 2 and 3; stage 1
// reduces at the step). The returned options carry one in-flight window: every core built
// from them (or from copies) shares it.
CoreOptions zero_options(int64_t stage, int64_t bucket_cap_bytes, int64_t first_bucket_cap_bytes,
                         const std::string& collective, const std::string& group_name,
                         int64_t max_inflight_buckets = 2);

}  // namespace mixprec::engines::sharded
