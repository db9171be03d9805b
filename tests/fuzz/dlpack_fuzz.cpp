// Fuzzes handoff::import_dlpack with versioned and legacy tensors built from the input: whatever
// the tensor says, its deleter runs exactly once, only the documented exceptions escape, and an
// accepted tensor satisfies the layout invariants (fuzz_support.hpp); an accepted one is also
// exported again and re-imported, which must give the same layout.
#include "fuzz_support.hpp"

#include <vector>

namespace {

using namespace handoff;

// A producer whose deleter counts its calls.
struct producer {
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;
  fuzz::arena storage;
  int deleted{0};
};

template <typename Managed>
void count_deletion(Managed* self)
{
  ++static_cast<producer*>(self->manager_ctx)->deleted;
}

DLDataType draw_dtype(FuzzedDataProvider& in)
{
  if (in.ConsumeIntegralInRange(0, 3) == 0) {  // any bits, to reach the refusals
    return {in.ConsumeIntegral<std::uint8_t>(), in.ConsumeIntegral<std::uint8_t>(),
            in.ConsumeIntegral<std::uint16_t>()};
  }
  constexpr DLDataType dtypes[] = {{kDLBool, 8, 1},      {kDLInt, 8, 1},           {kDLUInt, 16, 1},
                                   {kDLFloat, 32, 1},    {kDLFloat, 64, 1},        {kDLBfloat, 16, 1},
                                   {kDLComplex, 128, 1}, {kDLFloat4_e2m1fn, 4, 1}, {kDLFloat, 32, 4}};
  return in.PickValueInArray(dtypes);
}

DLTensor draw_tensor(FuzzedDataProvider& in, producer& p)
{
  DLTensor t{};
  t.ndim = in.ConsumeIntegralInRange<std::int32_t>(-1, 6);
  const auto ndim = static_cast<std::size_t>(t.ndim > 0 ? t.ndim : 0);
  for (std::size_t i = 0; i < ndim; ++i) { p.shape.push_back(fuzz::mostly_small(in, 0, 4)); }
  for (std::size_t i = 0; i < ndim; ++i) { p.strides.push_back(fuzz::mostly_small(in, -6, 6)); }
  t.shape = in.ConsumeIntegralInRange(0, 15) == 0 ? nullptr : p.shape.data();
  t.strides = in.ConsumeBool() ? nullptr : p.strides.data();
  t.dtype = draw_dtype(in);
  t.device = {static_cast<DLDeviceType>(in.ConsumeIntegralInRange<std::int32_t>(-1, 20)),
              in.ConsumeIntegral<std::int32_t>()};
  t.byte_offset =
    in.ConsumeBool() ? in.ConsumeIntegralInRange<std::uint64_t>(0, 64) : in.ConsumeIntegral<std::uint64_t>();
  // Data is null or inside the arena, so that whatever is accepted and falls inside it can be read.
  t.data =
    in.ConsumeIntegralInRange(0, 7) == 0 ? nullptr : p.storage.bytes + in.ConsumeIntegralInRange<std::size_t>(0, 512);
  return t;
}

// Exports `view` and imports the result: the same layout comes back, and the export's deleter
// releases the reference it held.
void round_trip(const array& view)
{
  const long before = view.owner().use_count();
  {
    const array again = import_dlpack(export_versioned(view));
    HANDOFF_FUZZ_CHECK(again.data() == view.data() && again.readonly() == view.readonly());
    HANDOFF_FUZZ_CHECK(again.layout().shape == view.layout().shape);
    HANDOFF_FUZZ_CHECK(again.layout().strides == view.layout().strides);
  }
  if (!view.readonly() && view.dtype().bits >= 8) {
    const array legacy = import_dlpack(export_legacy(view));
    HANDOFF_FUZZ_CHECK(legacy.layout().strides == view.layout().strides);
  }
  HANDOFF_FUZZ_CHECK(view.owner().use_count() == before);
}

template <typename Managed>
void import_one(Managed& managed, producer& p)
{
  try {
    const array view = import_dlpack(&managed);
    HANDOFF_FUZZ_CHECK(p.deleted == 0);
    fuzz::check_layout(view.layout(), p.storage);
    round_trip(view);
    HANDOFF_FUZZ_CHECK(p.deleted == 0);
  } catch (const value_error&) {
  } catch (const buffer_error&) {}
  HANDOFF_FUZZ_CHECK(p.deleted == 1);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size)
{
  FuzzedDataProvider in{data, size};
  producer p;
  const bool legacy = in.ConsumeBool();
  if (legacy) {
    DLManagedTensor managed{};
    managed.manager_ctx = &p;
    managed.deleter = &count_deletion<DLManagedTensor>;
    managed.dl_tensor = draw_tensor(in, p);
    import_one(managed, p);
  } else {
    DLManagedTensorVersioned managed{};
    managed.version = {in.ConsumeBool() ? 1U : in.ConsumeIntegral<std::uint32_t>(),
                       in.ConsumeIntegral<std::uint32_t>()};
    managed.flags = in.ConsumeIntegral<std::uint64_t>();
    managed.manager_ctx = &p;
    managed.deleter = &count_deletion<DLManagedTensorVersioned>;
    managed.dl_tensor = draw_tensor(in, p);
    import_one(managed, p);
  }
  return 0;
}
