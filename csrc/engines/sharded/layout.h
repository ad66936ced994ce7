// Flat layout of a sharded engine: which bucket each parameter lives in, where,
// and which slice of every bucket each rank owns.
//
// [Note: bucket order]
// Same rule as the DDP Reducer (csrc/engines/replicated/reducer.h): parameters
// are registered in model order and packed into buckets in REVERSE order, one
// run per (storage dtype, device), with a small first bucket so communication
// starts early. Buckets are numbered in launch order (the bucket holding the
// last parameter first); every rank issues the bucket collectives in exactly that
// order, whatever order its gradient hooks fire in.
//
// [Note: even split]
// Every bucket is padded to a multiple of the world size so it splits into N
// equal shards: rank r owns elements [r*S, (r+1)*S) of every bucket. One
// reduce-scatter / all-gather per bucket then needs no uneven-split support
// from the transport. The padding is zero in gradients and parameters and is
// never shown to the optimizer. A rank's flat shard is the concatenation of its
// slices of all buckets, in bucket order.
//
// [Note: aligned slots]
// Every parameter's slot starts at a 16-byte boundary of the bucket (kSlotAlignBytes), and
// every bucket is padded to a multiple of N * that alignment, so every shard, every shard
// offset, and so every owned range that starts a parameter or a shard is 16-byte aligned
// in all the flat buffers that share the bucket's offsets: the storage-dtype parameter
// buffer (bf16/fp16: multiples of 8 elements), the fp32 gradient buckets, the fp32 master
// and gradient shards (multiples of 4). The alignment in elements is 16 bytes over the
// narrower of the storage dtype and fp32 (slot_alignment). The CUDA multi-tensor kernels
// take their vectorised path only when every operand is 16-byte aligned
// (csrc/kernels/cuda/multi_tensor_apply.cuh); a shard segment at an odd offset would make
// the whole tensor scalar. The gaps (at most 15 bytes per parameter) are padding like the
// even-split tail: zero in every buffer, owned by no parameter, never part of a segment
// the optimizer steps (src/mixprec/engines/sharded.py) nor of a checkpoint.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

namespace mixprec::engines::sharded {

constexpr int64_t kSlotAlignBytes = 16;  // [Note: aligned slots]
// Elements per aligned step of a bucket whose parameters are stored in `storage_dtype`.
int64_t slot_alignment(c10::ScalarType storage_dtype);

struct LayoutParam {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  c10::ScalarType storage_dtype = c10::ScalarType::Float;
  c10::Device device = c10::Device(c10::kCPU);
};

struct LayoutBucket {
  std::vector<size_t> params;  // indices into the param list, in layout order
  std::vector<int64_t> offsets;  // element offset of each param in the bucket (aligned)
  int64_t numel = 0;           // end of the last param's slot (alignment gaps included)
  int64_t padded = 0;          // numel rounded up to a multiple of world size * alignment
  int64_t shard = 0;           // padded / world_size: elements each rank owns
  int64_t shard_offset = 0;    // where this bucket's shard starts in the rank's flat shard
  int64_t global_offset = 0;   // where the bucket starts in the global padded flat space
  c10::ScalarType storage_dtype = c10::ScalarType::Float;
};

// The part of one parameter a rank owns.
struct OwnedRange {
  size_t param = 0;            // index into the param list
  int64_t shard_offset = 0;    // offset in the rank's flat shard
  int64_t param_offset = 0;    // offset inside the flattened parameter
  int64_t numel = 0;
};

class Layout {
 public:
  Layout(std::vector<LayoutParam> params, int64_t world_size, int64_t rank,
         int64_t bucket_cap_bytes, int64_t first_bucket_cap_bytes);

  const std::vector<LayoutParam>& params() const { return params_; }
  const std::vector<LayoutBucket>& buckets() const { return buckets_; }
  int64_t world_size() const { return world_size_; }
  int64_t rank() const { return rank_; }
  int64_t shard_numel() const { return shard_numel_; }    // this rank's flat shard
  int64_t padded_numel() const { return padded_numel_; }  // all buckets, padded
  int64_t param_numel() const { return param_numel_; }    // all parameters, unpadded
  size_t bucket_of(size_t param) const { return bucket_of_[param]; }
  int64_t offset_of(size_t param) const { return offset_of_[param]; }

  // What `rank` owns, in shard order (ranges never cross a parameter boundary).
  std::vector<OwnedRange> owned(int64_t rank) const;

 private:
  std::vector<LayoutParam> params_;
  std::vector<LayoutBucket> buckets_;
  std::vector<size_t> bucket_of_;
  std::vector<int64_t> offset_of_;
  int64_t world_size_;
  int64_t rank_;
  int64_t shard_numel_ = 0;
  int64_t padded_numel_ = 0;
  int64_t param_numel_ = 0;
};

}  // namespace mixprec::engines::sharded
