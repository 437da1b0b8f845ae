// ShardingOptions::offload: the host state and worker (offload.h), the choice of units, and the
// names of the kinds.
#include "src/fsdp/offload.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "fsdp/trace.h"

namespace fsdp {

std::string_view OffloadName(OffloadKind k) {
  switch (k) {
    case OffloadKind::kNone: return "none";
    case OffloadKind::kOptimizer: return "optimizer";
    case OffloadKind::kAll: return "all";
  }
  return "?";
}

absl::StatusOr<OffloadKind> ParseOffload(std::string_view name) {
  const std::string n = absl::AsciiStrToLower(std::string(name));
  if (n == "none") return OffloadKind::kNone;
  if (n == "optimizer") return OffloadKind::kOptimizer;
  if (n == "all") return OffloadKind::kAll;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown offload '", std::string(name), "'; use none, optimizer (the AdamW state of the "
      "chosen units in host memory, updated on the host) or all (their parameter and gradient "
      "shards too)"));
}

absl::StatusOr<std::vector<int>> ChooseOffloadedUnits(const OffloadOptions& o,
                                                      const std::vector<std::string>& names,
                                                      const std::vector<int64_t>& shard_numel) {
  std::vector<int> chosen;
  if (o.what == OffloadKind::kNone) return chosen;
  const int n = static_cast<int>(shard_numel.size());
  if (!o.units.empty()) {
    for (const std::string& want : o.units) {
      const auto it = std::find(names.begin(), names.end(), want);
      if (it == names.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "offload.units names unit '", want, "', which is not registered; the units are: ",
            absl::StrJoin(names, ", ")));
      }
      chosen.push_back(static_cast<int>(it - names.begin()));
    }
  } else {
    std::vector<int> order(n);
    std::iota(order.begin(), order.end(), 0);
    // Largest first, ties by name (then by index, for units without names): independent of
    // the order of registration.
    std::sort(order.begin(), order.end(), [&](int a, int b) {
      if (shard_numel[a] != shard_numel[b]) return shard_numel[a] > shard_numel[b];
      const std::string& na = a < static_cast<int>(names.size()) ? names[a] : std::string();
      const std::string& nb = b < static_cast<int>(names.size()) ? names[b] : std::string();
      if (na != nb) return na < nb;
      return a < b;
    });
    int64_t used = 0;
    for (int u : order) {
      const int64_t b = OffloadHostBytes(shard_numel[u], o.what);
      if (o.budget_bytes >= 0 && b > o.budget_bytes - used) break;
      used += b;
      chosen.push_back(u);
    }
  }
  std::sort(chosen.begin(), chosen.end());
  chosen.erase(std::unique(chosen.begin(), chosen.end()), chosen.end());
  return chosen;
}

}  // namespace fsdp

namespace fsdp::internal {

absl::StatusOr<std::unique_ptr<HostOffload>> HostOffload::Create(Backend* device, int threads) {
  FSDP_ASSIGN_OR_RETURN(std::unique_ptr<CpuBackend> host,
                        CpuBackend::Create({.num_threads = std::max(1, threads)}));
  return std::unique_ptr<HostOffload>(new HostOffload(device, std::move(host)));
}

HostOffload::HostOffload(Backend* device, std::unique_ptr<CpuBackend> host)
    : device_(device), host_(std::move(host)), worker_([this] { Work(); }) {}

HostOffload::~HostOffload() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
  for (UnitState& s : units_) {
    if (s.param.bytes() != 0) device_->UnpinHostMemory(s.param.data());
    if (s.grad.bytes() != 0) device_->UnpinHostMemory(s.grad.data());
    if (s.arriving.bytes() != 0) device_->UnpinHostMemory(s.arriving.data());
  }
  if (factor_.bytes() != 0) device_->UnpinHostMemory(factor_.data());
}

absl::Status HostOffload::AddUnit(int u, int64_t shard_numel, std::vector<DecayRange> ranges,
                                  const AdamWOptions& options,
                                  std::unique_ptr<Optimizer>* optimizer,
                                  const float* all_params) {
  if (u >= static_cast<int>(units_.size())) units_.resize(u + 1);
  UnitState& s = units_[u];
  const size_t bytes = static_cast<size_t>(shard_numel) * 4;
  FSDP_ASSIGN_OR_RETURN(std::unique_ptr<AdamW> opt,
                        AdamW::Create(host_.get(), shard_numel, std::move(ranges), options));
  FSDP_ASSIGN_OR_RETURN(s.param, Buffer::Create(host_.get(), bytes));
  FSDP_ASSIGN_OR_RETURN(s.grad, Buffer::Create(host_.get(), bytes));
  FSDP_RETURN_IF_ERROR(device_->PinHostMemory(s.param.data(), bytes));
  FSDP_RETURN_IF_ERROR(device_->PinHostMemory(s.grad.data(), bytes));
  host_bytes_ += static_cast<int64_t>(s.param.bytes() + s.grad.bytes());
  if (all_params != nullptr) {
    s.all = true;
    std::memcpy(s.param.data(), all_params, bytes);
    std::memset(s.grad.data(), 0, bytes);
    FSDP_ASSIGN_OR_RETURN(s.arriving, Buffer::Create(host_.get(), bytes));
    FSDP_RETURN_IF_ERROR(device_->PinHostMemory(s.arriving.data(), bytes));
    host_bytes_ += static_cast<int64_t>(s.arriving.bytes());
    if (factor_.bytes() == 0) {
      FSDP_ASSIGN_OR_RETURN(factor_, Buffer::Create(host_.get(), 4));
      FSDP_RETURN_IF_ERROR(device_->PinHostMemory(factor_.data(), 4));
    }
  }
  for (const OptimizerState& st : opt->state()) host_bytes_ += static_cast<int64_t>(st.bytes);
  s.opt = opt.get();
  *optimizer = std::move(opt);
  return absl::OkStatus();
}

void HostOffload::Push(Job job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    UnitState& s = units_[job.unit];
    if (job.kind == Job::kUpdate) {
      s.pending = true;
      s.done = false;
      s.status = absl::OkStatus();
    } else {
      ++s.arrivals;
    }
    jobs_.push_back(std::move(job));
  }
  cv_.notify_all();
}

absl::Status HostOffload::IssueUpdate(int u, View param_shard, View grad_shard, float lr) {
  UnitState& s = units_[u];
  const int64_t n = s.opt->numel();
  // On the communication stream, after the compute stream's work so far (the clipping): the
  // copies run beside the device's update of the other units and the next forward, and the
  // gradient shard is zeroed behind them for the next step's accumulation.
  constexpr Stream kCopy = Stream::kComm;
  FSDP_RETURN_IF_ERROR(device_->Wait(kCopy, device_->Record(Stream::kCompute)));
  FSDP_RETURN_IF_ERROR(device_->CopyToHostAsync(s.param.data(), param_shard.Slice(0, n), kCopy));
  FSDP_RETURN_IF_ERROR(device_->CopyToHostAsync(s.grad.data(), grad_shard.Slice(0, n), kCopy));
  FSDP_RETURN_IF_ERROR(device_->Memset(grad_shard, 0, kCopy));
  Job job;
  job.unit = u;
  job.copied = device_->Record(kCopy);
  job.lr = lr;
  s.copied = job.copied;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.bytes_to_host += 8 * n;
  }
  Push(std::move(job));
  return absl::OkStatus();
}

absl::Status HostOffload::IssueFactor(View factor) {
  FSDP_RETURN_IF_ERROR(device_->CopyToHostAsync(factor_.data(), factor.Slice(0, 1),
                                                Stream::kCompute));
  factor_ready_ = device_->Record(Stream::kCompute);
  return absl::OkStatus();
}

absl::Status HostOffload::IssueHostUpdate(int u, bool scale, float lr) {
  Job job;
  job.unit = u;
  job.copied = factor_ready_;
  job.lr = lr;
  job.all = true;
  job.scale = scale;
  Push(std::move(job));
  return absl::OkStatus();
}

absl::StatusOr<Event> HostOffload::IssueGradientDown(int u, View grad) {
  UnitState& s = units_[u];
  const int64_t n = s.opt->numel();
  {
    // The staging takes one gradient at a time: the last one's addition must be done (it is,
    // but for a host that runs far ahead: the next micro-batch's backward of the same unit).
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return s.arrivals == 0; });
    stats_.bytes_to_host += 4 * n;
  }
  constexpr Stream kCopy = Stream::kComm;
  FSDP_RETURN_IF_ERROR(device_->Wait(kCopy, device_->Record(Stream::kCompute)));
  FSDP_RETURN_IF_ERROR(device_->CopyToHostAsync(s.arriving.data(), grad.Slice(0, n), kCopy));
  Job job;
  job.kind = Job::kAdd;
  job.unit = u;
  job.copied = device_->Record(kCopy);
  const Event arrived = job.copied;
  Push(std::move(job));
  return arrived;
}

absl::Status HostOffload::WaitGradients(int u) {
  UnitState& s = units_[u];
  absl::Status status;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return s.arrivals == 0; });
    status = s.arrival_status;
  }
  return status;
}

absl::Status HostOffload::CopyUp(int u, View dst, const Buffer& src) {
  const int64_t n = units_[u].opt->numel();
  FSDP_RETURN_IF_ERROR(device_->CopyFromHostAsync(dst.Slice(0, n), src.data()));
  std::lock_guard<std::mutex> lock(mu_);
  stats_.bytes_to_device += 4 * n;
  return absl::OkStatus();
}

absl::Status HostOffload::UploadParams(int u, View dst) {
  FSDP_RETURN_IF_ERROR(WaitUpdate(u));
  return CopyUp(u, dst, units_[u].param);
}

absl::Status HostOffload::UploadGradient(int u, View dst) {
  FSDP_RETURN_IF_ERROR(WaitGradients(u));
  return CopyUp(u, dst, units_[u].grad);
}

View HostOffload::host_params(int u) {
  WaitUpdate(u).IgnoreError();  // (its error is reported by the next hook)
  return units_[u].param.view().Slice(0, units_[u].opt->numel());
}

View HostOffload::host_grads(int u) {
  WaitGradients(u).IgnoreError();
  WaitUpdate(u).IgnoreError();
  return units_[u].grad.view().Slice(0, units_[u].opt->numel());
}

absl::Status HostOffload::DropGradients(int u) {
  FSDP_RETURN_IF_ERROR(WaitGradients(u));
  std::memset(units_[u].grad.data(), 0, units_[u].grad.bytes());
  return absl::OkStatus();
}

absl::Status HostOffload::WaitUpdate(int u) {
  if (!pending(u)) return absl::OkStatus();
  UnitState& s = units_[u];
  absl::Status status;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!s.done) {
      // The device's compute stream may still run work issued before: the wait is exposed
      // only from when that work was done (an event without a completion time: all of it).
      const Event busy = device_->Record(Stream::kCompute);
      TraceSpan span("offloaded update", kWaitStream, {{"unit", std::to_string(u)}});
      const auto t0 = std::chrono::steady_clock::now();
      cv_.wait(lock, [&] { return s.done; });
      const auto t1 = std::chrono::steady_clock::now();
      auto idle_from = t0;
      if (const auto done = busy.completed_at(); busy.Done() && done.has_value()) {
        idle_from = std::min(t1, std::max(t0, *done));
      } else if (!busy.Done()) {
        idle_from = t1;  // still busy after the wait: none of it was exposed
      }
      stats_.wait_seconds += std::chrono::duration<double>(t1 - t0).count();
      stats_.exposed_seconds += std::chrono::duration<double>(t1 - idle_from).count();
    }
    status = s.status;
    s.pending = false;
  }
  return status;
}

absl::Status HostOffload::EnsureUploaded(int u, View param_shard) {
  if (!pending(u)) return absl::OkStatus();
  UnitState& s = units_[u];
  FSDP_RETURN_IF_ERROR(WaitUpdate(u));
  // The compute stream goes on after the copies and the gradient's zeroing (done: the host
  // had the shards), so its next accumulation into the gradient shard follows them.
  FSDP_RETURN_IF_ERROR(device_->Wait(Stream::kCompute, s.copied));
  return CopyUp(u, param_shard, s.param);
}

void HostOffload::Work() {
  host_->BindCurrentThread();
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, nothing left
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    UnitState& s = units_[job.unit];
    absl::Status status = job.copied.Wait();
    const auto t0 = std::chrono::steady_clock::now();
    RuntimeOps& ops = host_->runtime_ops();
    const int64_t n = s.opt->numel();
    if (job.kind == Job::kAdd) {
      // The same kernel as the device's accumulation into its gradient shard.
      if (status.ok()) {
        const View g = s.grad.view().Slice(0, n);
        ops.Add(Stream::kCompute, g, g, s.arriving.view().Slice(0, n));
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!status.ok() && s.arrival_status.ok()) {
          s.arrival_status = absl::Status(status.code(),
                                  absl::StrCat("the gradient of unit ", job.unit,
                                               " on its way to the host: ", status.message()));
        }
        --s.arrivals;
      }
      cv_.notify_all();
      continue;
    }
    if (status.ok()) {
      const View g = s.grad.view().Slice(0, n);
      if (job.all && job.scale) ops.ScaleBy(Stream::kCompute, g, factor_.view());
      s.opt->set_lr(job.lr);
      status = s.opt->Step(s.param.view().Slice(0, n), g);
      if (job.all && status.ok()) status = host_->Memset(g, 0);
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    {
      std::lock_guard<std::mutex> lock(mu_);
      s.status = status.ok() ? status
                             : absl::Status(status.code(),
                                            absl::StrCat("the host's optimizer update of unit ",
                                                         job.unit, ": ", status.message()));
      s.done = true;
      stats_.updates += 1;
      stats_.host_update_seconds += seconds;
    }
    cv_.notify_all();
  }
}

void HostOffload::Drain() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] {
    if (!jobs_.empty()) return false;
    for (const UnitState& s : units_) {
      if ((s.pending && !s.done) || s.arrivals > 0) return false;
    }
    return true;
  });
}

std::vector<int> HostOffload::units() const {
  std::vector<int> out;
  for (int u = 0; u < static_cast<int>(units_.size()); ++u) {
    if (units_[u].opt != nullptr) out.push_back(u);
  }
  return out;
}

OffloadStats HostOffload::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace fsdp::internal
