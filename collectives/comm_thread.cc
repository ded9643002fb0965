#include "dtensor/collectives/comm_thread.h"

#include <utility>

namespace dtensor {
namespace {

thread_local bool t_on_comm_thread = false;

// The outcome of one job, shared by the job and its Work.
struct JobState {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  absl::Status status;
};

class JobWork final : public Work {
 public:
  explicit JobWork(std::shared_ptr<JobState> state) : state_(std::move(state)) {}
  absl::Status Wait() override {
    std::unique_lock<std::mutex> lock(state_->mu);
    state_->cv.wait(lock, [&] { return state_->done; });
    return state_->status;
  }
  bool IsCompleted() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    return state_->done;
  }

 private:
  std::shared_ptr<JobState> state_;
};

}  // namespace

CommThread::~CommThread() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::unique_ptr<Work> CommThread::Submit(std::function<absl::Status()> job) {
  auto state = std::make_shared<JobState>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back([state, job = std::move(job)]() mutable {
      absl::Status s = job();
      job = nullptr;  // release the captures before anyone is told
      {
        std::lock_guard<std::mutex> l(state->mu);
        state->status = std::move(s);
        state->done = true;
      }
      state->cv.notify_all();
    });
    pending_.fetch_add(1, std::memory_order_relaxed);
    if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
  }
  cv_.notify_one();
  return std::make_unique<JobWork>(std::move(state));
}

void CommThread::Drain() {
  if (pending_.load(std::memory_order_acquire) == 0) return;  // the jobs' effects are visible
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [&] { return jobs_.empty() && !running_; });
}

bool CommThread::idle() const {
  std::lock_guard<std::mutex> lock(mu_);
  return jobs_.empty() && !running_;
}

bool CommThread::OnCommThread() { return t_on_comm_thread; }

void CommThread::Loop() {
  t_on_comm_thread = true;
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
    if (jobs_.empty()) return;  // stopping, nothing left
    std::function<void()> job = std::move(jobs_.front());
    jobs_.pop_front();
    running_ = true;
    lock.unlock();
    job();
    job = nullptr;
    pending_.fetch_sub(1, std::memory_order_release);
    lock.lock();
    running_ = false;
    if (jobs_.empty()) idle_cv_.notify_all();
  }
}

}  // namespace dtensor
