// The test seam of set_storage_bytes's device guard (core.h; issue 23, G8): CUDA with one
// GPU, or none, cannot show on which device a re-made parameter storage is allocated, so
// this runs set_storage_bytes on a fake device type with a fake current device, and an
// allocator that records which device was current when it allocated.
#include "engines/sharded/core.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>

namespace mixprec::engines::sharded {

namespace {

constexpr auto kFakeType = c10::DeviceType::PrivateUse1;
using FakeGuard = c10::impl::FakeGuardImpl<kFakeType>;

// Host memory handed out as memory of (PrivateUse1, index); remembers the device that was
// current (per the registered guard) at each allocation.
struct RecordingAllocator final : c10::Allocator {
  explicit RecordingAllocator(c10::DeviceIndex index) : index(index) {}
  c10::DataPtr allocate(size_t n) override {
    seen = c10::impl::getDeviceGuardImpl(kFakeType)->getDevice().index();
    void* p = n == 0 ? nullptr : std::malloc(n);
    TORCH_CHECK(n == 0 || p != nullptr, "probe_storage_allocation_device: malloc(", n, ") failed");
    return {p, p, &std::free, c10::Device(kFakeType, index)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &std::free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  c10::DeviceIndex index;
  int64_t seen = -1;
};

}  // namespace

StorageAllocationProbe probe_storage_allocation_device(int64_t index) {
  TORCH_CHECK_VALUE(index >= 1 && index < c10::impl::kFakeGuardImplMaxDevices,
                    "probe_storage_allocation_device: index must be in [1, ",
                    static_cast<int>(c10::impl::kFakeGuardImplMaxDevices), "), got ", index,
                    " (the fake device's current index is 0, so 0 would show nothing)");
  // Registry entries are never freed (DeviceGuardImplInterface's contract): one, leaked.
  static FakeGuard* const fake = new FakeGuard();
  auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(kFakeType)];
  const c10::impl::DeviceGuardImplInterface* expected = nullptr;
  TORCH_CHECK(slot.compare_exchange_strong(expected, fake),
              "probe_storage_allocation_device needs the PrivateUse1 device type unregistered, "
              "but a backend registered a device guard for it in this process; run the probe in "
              "a process without that backend");
  struct Unregister {
    std::atomic<const c10::impl::DeviceGuardImplInterface*>& slot;
    ~Unregister() { slot.store(nullptr); }
  } unregister{slot};

  fake->setDevice(c10::Device(kFakeType, 0));
  RecordingAllocator allocator(static_cast<c10::DeviceIndex>(index));
  auto storage = c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), 0, allocator.allocate(0), &allocator, /*resizable=*/true);
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(std::move(storage)), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      caffe2::TypeMeta::Make<float>());
  StorageAllocationProbe out{};
  out.tensor_index = t.device().index();
  out.current_before = fake->getDevice().index();
  allocator.seen = -1;
  set_storage_bytes(t, 64);
  out.allocated_on = allocator.seen;
  out.current_after = fake->getDevice().index();
  set_storage_bytes(t, 0);  // the 64 bytes go back through the DataPtr's deleter
  return out;
}

}  // namespace mixprec::engines::sharded
