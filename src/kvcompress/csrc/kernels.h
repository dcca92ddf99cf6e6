// The CPU kernels (one extension module, bound in module.cpp); each file's header comment gives its contract.
#pragma once

#include <torch/extension.h>

#include <vector>

std::vector<at::Tensor> paged_decode(const at::Tensor& query, double scaling, const at::Tensor& keys, const at::Tensor& values,
                                     const std::vector<at::Tensor>& tables, const at::Tensor& lengths,
                                     const std::vector<at::Tensor>& weights, int64_t tier_shift, const std::vector<int64_t>& kivi_spec,
                                     const std::vector<at::Tensor>& kivi_arrays, at::Tensor scores);

at::Tensor top_pages(const at::Tensor& bound, const at::Tensor& useful, const at::Tensor& count, const at::Tensor& protected_columns,
                     const at::Tensor& open, int64_t page_size, int64_t pages);

std::vector<at::Tensor> deltakv_rebuild(const at::Tensor& entries, const at::Tensor& codes, const at::Tensor& code_zero,
                                        const at::Tensor& code_scale, const at::Tensor& refs, const at::Tensor& positions,
                                        const at::Tensor& layers, const at::Tensor& ref_keys, const at::Tensor& ref_values,
                                        const at::Tensor& ref_positions, const at::Tensor& decoder, const at::Tensor& scale,
                                        const at::Tensor& rotary);
