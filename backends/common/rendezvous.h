// Part of the kit the device backends share (backends/common): where the ranks of a group,
// threads of one process, meet when their data planes are made, to share one object (the sim
// and pjrt planes' LocalWorld, the CUDA shared-GPU plane's group). Thread-safe.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "fsdp/status.h"

namespace fsdp::backend_kit {

// T: the shared object. One table per T for the life of the process.
template <class T>
class Rendezvous {
 public:
  // The first of the `size` ranks to arrive with `key` (the plane's kind, the group's name and
  // its backends' ids) makes the object with `make`; every rank then runs `take` on it under
  // the table's lock (e.g. LocalWorld::TakeRank, which is not thread-safe), and the entry goes
  // once all `size` ranks have taken theirs. A failed `make` leaves no entry behind.
  template <class R>
  static absl::StatusOr<R> Join(const std::string& key, int size,
                                const std::function<absl::StatusOr<std::unique_ptr<T>>()>& make,
                                const std::function<absl::StatusOr<R>(const std::shared_ptr<T>&)>& take) {
    static std::mutex mu;
    static auto* entries = new std::map<std::string, Entry>();  // never destroyed
    std::lock_guard<std::mutex> lock(mu);
    Entry& e = (*entries)[key];
    if (e.object == nullptr) {
      absl::StatusOr<std::unique_ptr<T>> made = make();
      if (!made.ok()) {
        entries->erase(key);
        return made.status();
      }
      e.object = std::shared_ptr<T>(*std::move(made));
    }
    const std::shared_ptr<T> object = e.object;
    absl::StatusOr<R> taken = take(object);
    if (++e.taken == size) entries->erase(key);
    return taken;
  }

 private:
  struct Entry {
    std::shared_ptr<T> object;
    int taken = 0;
  };
};

}  // namespace fsdp::backend_kit
