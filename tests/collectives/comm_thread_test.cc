// CommThread: jobs run one at a time in submission order on another thread; Submit returns at
// once; each Work reports its job's status; Drain returns when every job has run.
#include "dtensor/collectives/comm_thread.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace dtensor {
namespace {

TEST(CommThreadTest, JobsRunInOrderOffTheCallersThread) {
  CommThread t;
  EXPECT_TRUE(t.idle());
  std::mutex mu;
  std::vector<int> order;
  std::atomic<bool> release{false};
  const std::thread::id caller = std::this_thread::get_id();
  std::vector<std::unique_ptr<Work>> works;
  // The first job holds the thread until released: Submit must not wait for it.
  works.push_back(t.Submit([&] {
    while (!release.load()) std::this_thread::yield();
    std::lock_guard<std::mutex> l(mu);
    order.push_back(0);
    EXPECT_NE(std::this_thread::get_id(), caller);
    return absl::OkStatus();
  }));
  for (int i = 1; i < 5; ++i) {
    works.push_back(t.Submit([&, i] {
      std::lock_guard<std::mutex> l(mu);
      order.push_back(i);
      return i == 3 ? absl::DataLossError("job 3") : absl::OkStatus();
    }));
  }
  EXPECT_FALSE(t.idle());
  EXPECT_FALSE(works[4]->IsCompleted());
  release = true;
  EXPECT_TRUE(works[4]->Wait().ok());
  EXPECT_TRUE(works[0]->Wait().ok());
  EXPECT_TRUE(absl::IsDataLoss(works[3]->Wait()));
  t.Drain();
  EXPECT_TRUE(t.idle());
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4}));
}

// A dropped Work's job still runs, with its captures alive; destroying the thread runs what is
// queued first.
TEST(CommThreadTest, DroppedWorksStillRunAndDestructionDrains) {
  auto counter = std::make_shared<std::atomic<int>>(0);
  {
    CommThread t;
    for (int i = 0; i < 10; ++i) {
      t.Submit([counter] {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        counter->fetch_add(1);
        return absl::OkStatus();
      });
    }
  }
  EXPECT_EQ(counter->load(), 10);
}

}  // namespace
}  // namespace dtensor
