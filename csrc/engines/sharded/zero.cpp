#include "engines/sharded/zero.h"

#include "comm/process_group.h"

#include <c10/util/Exception.h>

namespace mixprec::engines::sharded {

CoreOptions zero_options(int64_t stage, int64_t bucket_cap_bytes, int64_t first_bucket_cap_bytes,
                         const std::string& collective, const std::string& group_name,
                         int64_t max_inflight_buckets) {
  TORCH_CHECK_VALUE(stage >= 1 && stage <= 3, "ZeRO stage=", stage,
                    " does not exist; use stage 1, 2 or 3");
  TORCH_CHECK_VALUE(max_inflight_buckets >= 1, "max_inflight_buckets=", max_inflight_buckets,
                    " must be >= 1 (gradient buckets reduced at once during backward)");
  CoreOptions o;
  o.bucket_cap_bytes = bucket_cap_bytes;
  o.first_bucket_cap_bytes = first_bucket_cap_bytes;
  o.reduce_in_backward = stage >= 2;
  // Every stage frees a bucket once its reduction is folded into the gradient shard: zero1
  // included, so its full fp32 gradient and the shard never both exist whole ([Note:
  // gradient shard pages] in core.h).
  o.free_grad_buckets = true;
  o.shard_params = stage >= 3;
  o.reshard_after_backward = stage >= 3;
  o.max_inflight_buckets = max_inflight_buckets;
  o.window = std::make_shared<InflightWindow>(max_inflight_buckets);
  if (collective == "reduce_scatter") {
    o.collective = Collective::kReduceScatter;
  } else if (collective == "allreduce") {
    o.collective = Collective::kAllReduce;
  } else if (collective == "auto") {
    // [Note: which collective] in core.h: Gloo's reduce-scatter measured slower than its
    // all-reduce of the same bucket (docs/zero.md), and both give the same owned slice.
    const bool gloo = comm::resolve(group_name)->getBackendName() == "gloo";
    o.collective = gloo ? Collective::kAllReduce : Collective::kReduceScatter;
  } else {
    TORCH_CHECK_VALUE(false, "collective='", collective,
                      "' is not one of 'auto', 'reduce_scatter', 'allreduce'");
  }
  return o;
}

}  // namespace mixprec::engines::sharded
