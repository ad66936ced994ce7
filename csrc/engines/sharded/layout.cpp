#include "engines/sharded/layout.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>

namespace mixprec::engines::sharded {

int64_t slot_alignment(c10::ScalarType storage_dtype) {
  // See [Note: aligned slots]: one offset serves the storage-dtype parameter buffer and the
  // fp32 gradient buckets and shards, so it must align both.
  const int64_t bytes = std::min<int64_t>(static_cast<int64_t>(c10::elementSize(storage_dtype)), 4);
  return kSlotAlignBytes / bytes;
}

Layout::Layout(std::vector<LayoutParam> params, int64_t world_size, int64_t rank,
               int64_t bucket_cap_bytes, int64_t first_bucket_cap_bytes)
    : params_(std::move(params)), world_size_(world_size), rank_(rank) {
  TORCH_CHECK_VALUE(world_size_ >= 1 && rank_ >= 0 && rank_ < world_size_, "rank ", rank_,
                    " is not in [0, world_size=", world_size_, ")");
  TORCH_CHECK_VALUE(bucket_cap_bytes > 0 && first_bucket_cap_bytes > 0,
                    "bucket caps must be positive, got bucket_cap_bytes=", bucket_cap_bytes,
                    " and first_bucket_cap_bytes=", first_bucket_cap_bytes);
  TORCH_CHECK_VALUE(!params_.empty(), "a sharded layout needs at least one parameter");
  // See [Note: bucket order]. Caps count fp32 gradient bytes: that is what is reduced.
  struct Open {
    std::vector<size_t> params;
    int64_t bytes = 0;
    bool first = true;
  };
  std::map<std::pair<c10::ScalarType, std::string>, Open> open;
  std::vector<std::vector<size_t>> closed;
  for (size_t k = params_.size(); k-- > 0;) {
    auto& bucket = open[{params_[k].storage_dtype, params_[k].device.str()}];
    bucket.params.push_back(k);
    bucket.bytes += params_[k].numel * 4;
    const int64_t cap = bucket.first ? first_bucket_cap_bytes : bucket_cap_bytes;
    if (bucket.bytes >= cap) {
      closed.push_back(std::move(bucket.params));
      bucket.params.clear();
      bucket.bytes = 0;
      bucket.first = false;
    }
  }
  for (auto& [key, bucket] : open) {
    if (!bucket.params.empty()) closed.push_back(std::move(bucket.params));
  }
  std::sort(closed.begin(), closed.end(),
            [](const auto& a, const auto& b) { return a.front() > b.front(); });
  bucket_of_.assign(params_.size(), 0);
  offset_of_.assign(params_.size(), 0);
  buckets_.resize(closed.size());
  for (size_t b = 0; b < closed.size(); ++b) {
    auto& bucket = buckets_[b];
    bucket.params = std::move(closed[b]);
    bucket.storage_dtype = params_[bucket.params.front()].storage_dtype;
    // See [Note: aligned slots].
    const int64_t align = slot_alignment(bucket.storage_dtype);
    for (auto i : bucket.params) {
      const int64_t offset = (bucket.numel + align - 1) / align * align;
      bucket_of_[i] = b;
      offset_of_[i] = offset;
      bucket.offsets.push_back(offset);
      bucket.numel = offset + params_[i].numel;
      param_numel_ += params_[i].numel;
    }
    // See [Note: even split]: every shard a whole number of aligned slots.
    const int64_t unit = world_size_ * align;
    bucket.padded = (bucket.numel + unit - 1) / unit * unit;
    bucket.shard = bucket.padded / world_size_;
    bucket.shard_offset = shard_numel_;
    bucket.global_offset = padded_numel_;
    shard_numel_ += bucket.shard;
    padded_numel_ += bucket.padded;
  }
}

std::vector<OwnedRange> Layout::owned(int64_t rank) const {
  TORCH_CHECK_VALUE(rank >= 0 && rank < world_size_, "rank ", rank, " is not in [0, ",
                    world_size_, ")");
  std::vector<OwnedRange> out;
  for (const auto& bucket : buckets_) {
    const int64_t lo = rank * bucket.shard;
    const int64_t hi = lo + bucket.shard;
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      const int64_t start = bucket.offsets[k];
      const int64_t end = start + params_[bucket.params[k]].numel;
      const int64_t a = std::max(lo, start);
      const int64_t b = std::min(hi, end);
      if (a >= b) continue;
      out.push_back({bucket.params[k], bucket.shard_offset + (a - lo), a - start, b - a});
    }
  }
  return out;
}

}  // namespace mixprec::engines::sharded
