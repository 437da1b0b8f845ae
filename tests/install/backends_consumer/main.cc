// Lists the backends the installed package registers (fsdp::backends), then, for each backend
// asked for at build time that can run here, makes it by name, round-trips 1024 floats through
// its memory and checks them. With pjrt, it also names the backend's own class
// (fsdp/pjrt_backend.h from fsdp::pjrt). Prints "backends_consumer: ok" at the end.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <fsdp/fsdp.h>
#ifdef WANT_PJRT
#include <fsdp/pjrt_backend.h>
#endif

namespace {

int RoundTrip(const std::string& name) {
  auto backend = fsdp::CreateBackend(name, {}, 0);
  if (!backend.ok()) {
    std::fprintf(stderr, "backends_consumer: %s: %s\n", name.c_str(),
                 backend.status().ToString().c_str());
    return 1;
  }
  std::vector<float> in(1024), out(1024, 0.0f);
  for (size_t i = 0; i < in.size(); ++i) in[i] = 0.5f * static_cast<float>(i) - 3.0f;
  auto buffer = fsdp::Buffer::Create(backend->get(), in.size() * sizeof(float));
  absl::Status s = buffer.status();
  if (s.ok()) s = (*backend)->CopyFromHost(buffer->view(), in.data());
  if (s.ok()) s = (*backend)->CopyToHost(out.data(), buffer->view());
  if (!s.ok() || in != out) {
    std::fprintf(stderr, "backends_consumer: %s: round trip failed: %s\n", name.c_str(),
                 s.ToString().c_str());
    return 1;
  }
#ifdef WANT_PJRT
  if (name == "pjrt" && dynamic_cast<fsdp::PjrtBackend*>(backend->get()) == nullptr) {
    std::fprintf(stderr, "backends_consumer: pjrt made a backend that is not a PjrtBackend\n");
    return 1;
  }
#endif
  std::printf("backends_consumer: %s: %s: 1024 floats round-tripped\n", name.c_str(),
              (*backend)->description().c_str());
  return 0;
}

}  // namespace

int main() {
  std::vector<std::string> want = {"cpu", "sim"};
#ifdef WANT_PJRT
  want.push_back("pjrt");
#endif
#ifdef WANT_CUDA
  want.push_back("cuda");
#endif
  int failures = 0;
  for (const fsdp::BackendInfo& b : fsdp::ListBackends()) {
    std::printf("backends_consumer: registered %s: %s%s\n", b.name.c_str(), b.summary.c_str(),
                b.unavailable.empty() ? "" : (" (unavailable: " + b.unavailable + ")").c_str());
  }
  for (const std::string& name : want) {
    bool listed = false, runs = false;
    for (const fsdp::BackendInfo& b : fsdp::ListBackends()) {
      if (b.name != name) continue;
      listed = true;
      runs = b.unavailable.empty();
    }
    if (!listed) {
      std::fprintf(stderr, "backends_consumer: %s is not registered\n", name.c_str());
      ++failures;
    } else if (runs) {
      failures += RoundTrip(name);
    } else {
      std::printf("backends_consumer: %s is registered but cannot run here\n", name.c_str());
    }
  }
  if (failures == 0) std::printf("backends_consumer: ok\n");
  return failures == 0 ? 0 : 1;
}
