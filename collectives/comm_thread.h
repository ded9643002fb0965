// CommThread: runs a transport's collectives on a thread of their own, in the order they were
// issued, so that an *Async call returns at once and the collective makes progress while the
// caller computes. For transports whose progress is otherwise driven by the waiting call
// (ucx); NCCL has streams instead.
//
//   CommThread thread;
//   std::unique_ptr<Work> w = thread.Submit([=] { return DoAllGather(in, out); });  // at once
//   ...compute...                                       // the all_gather runs meanwhile
//   DT_RETURN_IF_ERROR(w->Wait());
//   thread.Drain();                                     // idle: safe to run a call inline
//
// Jobs run one at a time, first in first out; the thread starts with the first Submit and is
// joined (after the jobs left) when the object is destroyed. Drain() returns once every job
// submitted so far has run: a transport calls it before it runs a call on the caller's thread,
// so that its state is never touched by two threads at once and calls keep their order.
// Submit and Drain belong to one thread (the communicator's user); Work::Wait may be called
// from it after any number of later Submits. A job's captures (tensors, counts) live until it
// has run, so the caller may drop its Work.
#ifndef DTENSOR_COLLECTIVES_COMM_THREAD_H_
#define DTENSOR_COLLECTIVES_COMM_THREAD_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "absl/status/status.h"
#include "dtensor/collectives/communicator.h"

namespace dtensor {

class CommThread {
 public:
  CommThread() = default;
  ~CommThread();
  CommThread(const CommThread&) = delete;
  CommThread& operator=(const CommThread&) = delete;

  std::unique_ptr<Work> Submit(std::function<absl::Status()> job);
  void Drain();
  // True when no job is queued or running (then Drain() returns at once).
  bool idle() const;
  // Whether the calling thread is some CommThread's (its waits share the CPUs with the
  // caller's compute, so they should not spin).
  static bool OnCommThread();

 private:
  void Loop();
  mutable std::mutex mu_;
  std::condition_variable cv_;       // new jobs, stop
  std::condition_variable idle_cv_;  // a job finished
  std::deque<std::function<void()>> jobs_;
  bool running_ = false;  // a job is running
  // Jobs submitted and not finished: Drain() on an idle thread is one atomic load.
  std::atomic<int64_t> pending_{0};
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace dtensor

#endif  // DTENSOR_COLLECTIVES_COMM_THREAD_H_
