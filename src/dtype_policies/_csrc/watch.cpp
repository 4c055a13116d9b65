// What a compiled call's watch of its model reads from every parameter and
// buffer on every call (dtype_policies._frozen.ModelWatch), in one pass:
//   dtype_policies::tensor_layouts(tensors) -> int64 tensor
//     per tensor: its data address, its version (-1 for an inference
//     tensor, which has none), its dtype, its sizes and its strides
//     (`p.data = p.data.view(dtype)` of one item size keeps all but the dtype)
//   dtype_policies::tensor_layouts_match(tensors, recorded) -> bool
//     whether tensor_layouts(tensors) would equal `recorded`
// Only metadata is read, never the data, so any device's tensors are read.
// Read from Python one attribute at a time, the same comparison cost about
// 60 us per call for all-MiniLM-L6-v2's 145 tensors; this about 15 us.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>

namespace {

int64_t layout_length(const at::Tensor& tensor) { return 3 + 2 * tensor.dim(); }

int64_t dtype_of(const at::Tensor& tensor) { return static_cast<int64_t>(tensor.scalar_type()); }

int64_t version_of(const at::Tensor& tensor) {
  return tensor.is_inference() ? -1 : static_cast<int64_t>(tensor._version());
}

int64_t address_of(const at::Tensor& tensor) {
  return reinterpret_cast<int64_t>(tensor.data_ptr());
}

at::Tensor tensor_layouts(at::TensorList tensors) {
  int64_t length = 0;
  for (const auto& tensor : tensors) length += layout_length(tensor);
  at::Tensor recorded = at::empty({length}, at::TensorOptions().dtype(at::kLong));
  int64_t* out = recorded.data_ptr<int64_t>();
  for (const auto& tensor : tensors) {
    *out++ = address_of(tensor);
    *out++ = version_of(tensor);
    *out++ = dtype_of(tensor);
    for (const int64_t size : tensor.sizes()) *out++ = size;
    for (const int64_t stride : tensor.strides()) *out++ = stride;
  }
  return recorded;
}

bool tensor_layouts_match(at::TensorList tensors, const at::Tensor& recorded) {
  TORCH_CHECK(recorded.scalar_type() == at::kLong && recorded.dim() == 1 &&
                  recorded.is_contiguous() && recorded.device().is_cpu(),
              "tensor_layouts_match: `recorded` must be tensor_layouts' int64 tensor");
  const int64_t* expected = recorded.data_ptr<int64_t>();
  const int64_t length = recorded.numel();
  int64_t at = 0;
  for (const auto& tensor : tensors) {
    if (at + layout_length(tensor) > length) return false;
    if (expected[at++] != address_of(tensor)) return false;
    if (expected[at++] != version_of(tensor)) return false;
    if (expected[at++] != dtype_of(tensor)) return false;
    for (const int64_t size : tensor.sizes()) {
      if (expected[at++] != size) return false;
    }
    for (const int64_t stride : tensor.strides()) {
      if (expected[at++] != stride) return false;
    }
  }
  return at == length;
}

}  // namespace

// Defined with their functions: one kernel for every device and dispatch key
// (composite), which reads metadata only and runs before any tensor
// subclass's or dispatch mode's Python handler would see the call.
TORCH_LIBRARY_FRAGMENT(dtype_policies, m) {
  m.def("tensor_layouts(Tensor[] tensors) -> Tensor", &tensor_layouts);
  m.def("tensor_layouts_match(Tensor[] tensors, Tensor recorded) -> bool", &tensor_layouts_match);
}
