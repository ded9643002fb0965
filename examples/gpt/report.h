// What the trainer reports per step, as TorchTitan logs it: MFU from the model's FLOPs per
// token and the device's peak, memory as a share of the device's, and a progress bar with ETA.
//
//   const double fpt = gpt::FlopsPerToken(cfg, model->NumParameters(), T);   // ANCHORS.md's formula
//   DT_ASSIGN_OR_RETURN(double peak, gpt::PeakFlops(device, /*bf16=*/false, /*cpu_threads=*/4));
//   const double mfu = gpt::Mfu(fpt, tokens_per_s_per_rank, peak);            // 0..1; 0 when peak is 0
//   std::printf("%s\n", gpt::ProgressBar(step + 1, steps, elapsed_s, 30).c_str());
//
// FLOPs per token (forward + backward), TorchTitan's count for a model whose output layer is
// the tied token embedding: 6 (N - position-embedding parameters) + 12 L C T, where the second
// term is attention's QK^T and AV matmuls (L layers, C = heads x head dim, T tokens of context).
// Peak FLOP/s per device: a GPU's dense bf16 or fp32 (no TF32) peak by model name (H100/H200
// SXM 989 / 67 TFLOP/s, H100 PCIe 756 / 51, A100 312 / 19.5; 0 for an unknown GPU); on the
// CPU, the best of a few float32 GEMMs (OpenBLAS, 1024^3) on `cpu_threads` threads, measured.
#ifndef DTENSOR_EXAMPLES_GPT_REPORT_H_
#define DTENSOR_EXAMPLES_GPT_REPORT_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "dtensor/nn/gpt.h"
#include "dtensor/tensor/device.h"

namespace dtensor::gpt {

// Training FLOPs per token of `cfg` with `num_params` parameters at context `seq`.
double FlopsPerToken(const nn::GPTConfig& cfg, int64_t num_params, int64_t seq);

// A GPU's dense peak FLOP/s by the driver's name; 0 when the model is not in the table.
double GpuPeakFlops(const std::string& name, bool bf16);

// Peak FLOP/s of `device` (see above); the CPU's is measured on `cpu_threads` OpenMP threads.
absl::StatusOr<double> PeakFlops(Device device, bool bf16, int cpu_threads);

// Model FLOPs utilisation in [0, 1]: flops_per_token x tokens/s of one device / its peak (0
// when the peak is unknown).
inline double Mfu(double flops_per_token, double tokens_per_s_per_device, double peak) {
  return peak > 0 ? flops_per_token * tokens_per_s_per_device / peak : 0.0;
}

// "[#########-----------]  45/100  0:12 elapsed  0:15 left": `done` of `total` after
// `elapsed_s` seconds, `width` characters of bar; the ETA extrapolates the mean step time.
std::string ProgressBar(int64_t done, int64_t total, double elapsed_s, int width);

// "1:02:03" or "2:03" for a duration in seconds.
std::string FormatDuration(double seconds);

// Total memory of the device in bytes (the host's physical memory for the CPU); 0 if unknown.
int64_t DeviceMemoryBytes(Device device);

}  // namespace dtensor::gpt

#endif  // DTENSOR_EXAMPLES_GPT_REPORT_H_
