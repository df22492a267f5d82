// The one map from (dtype, head dim, group size) to a kernel instantiation, shared by the
// decode and MAC launchers: f(TypeTag<DType>, IntTag<HEAD_DIM>, IntTag<GROUP>) for bf16/f16,
// head dim 64/128 and group sizes 1..kDecodeMaxGroup. Anything else throws UnsupportedError
// naming `what` ("decode attention", "MAC attention") and the value.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>
#include <type_traits>
#include <utility>

#include "asmem/decode.h"
#include "asmem/error.h"

namespace asmem::kernel_dispatch {

template <typename T>
struct TypeTag {
  using type = T;
};
template <int N>
using IntTag = std::integral_constant<int, N>;

template <typename F, typename DT, typename HD, int GROUP>
void DispatchGroupFrom(const char* what, int group, F&& f, DT dt, HD hd) {
  if constexpr (GROUP <= kDecodeMaxGroup) {
    if (group == GROUP) {
      f(dt, hd, IntTag<GROUP>{});
      return;
    }
    DispatchGroupFrom<F, DT, HD, GROUP + 1>(what, group, std::forward<F>(f), dt, hd);
  } else {
    throw UnsupportedError(std::string(what) + ": group size " + std::to_string(group) +
                           " is not supported");
  }
}

template <typename F, typename DT>
void DispatchHeadDim(const char* what, int head_dim, int group, F&& f, DT dt) {
  switch (head_dim) {
    case 64:
      return DispatchGroupFrom<F, DT, IntTag<64>, 1>(what, group, std::forward<F>(f), dt, IntTag<64>{});
    case 128:
      return DispatchGroupFrom<F, DT, IntTag<128>, 1>(what, group, std::forward<F>(f), dt, IntTag<128>{});
    default:
      throw UnsupportedError(std::string(what) + ": head_dim " + std::to_string(head_dim) +
                             " is not supported");
  }
}

template <typename F>
void Dispatch(const char* what, KernelDType dtype, int head_dim, int group, F&& f) {
  switch (dtype) {
    case KernelDType::kBF16:
      return DispatchHeadDim(what, head_dim, group, std::forward<F>(f), TypeTag<__nv_bfloat16>{});
    case KernelDType::kF16:
      return DispatchHeadDim(what, head_dim, group, std::forward<F>(f), TypeTag<__half>{});
    default:
      throw UnsupportedError(std::string(what) + ": dtype " + KernelDTypeName(dtype) +
                             " is not supported");
  }
}

// log2 of a power of two (the page size).
inline int Log2(int x) {
  int s = 0;
  while ((1 << s) < x) ++s;
  return s;
}

}  // namespace asmem::kernel_dispatch
