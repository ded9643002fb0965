// Agreement across ranks on steps each rank does alone (opening a file, loading, checking
// its own arguments), so that all of them go on or all stop, instead of the ranks that
// succeeded waiting for the failed one in their next collective until the timeout.
//
//   absl::Status opened = OpenMyShard(path);                     // this rank alone
//   DT_RETURN_IF_ERROR(AgreeOnStatus(world, opened, "opening the shards"));
//   // every rank is here only if every rank opened its shard
//
// AgreeOnStatus: one all_gather of a flag per rank; only where some rank failed, a second
// one of the failed ranks' errors (AllGatherText). It returns OK when every rank's `mine` is
// OK; this rank's own error where it failed; else the first failed rank's code with a message
// naming every failed rank, `what` and that rank's message:
//   "opening the shards failed on rank(s) 1, 3; rank 1: NOT_FOUND: [Open] no file /x/1.bin"
// Every rank must call it (it is a collective). The communicator's own errors (a dead peer,
// the timeout, an abort) are returned as they are, except to a rank whose `mine` failed: it
// keeps its own code and message, the communicator's error appended.
//
// AllGatherText: every rank's string, in rank order (e.g. a JSON document of what each rank
// wrote); lengths may differ and be 0. AllGatherInts: a fixed-size record of int64s per rank.
#ifndef DTENSOR_COLLECTIVES_AGREE_H_
#define DTENSOR_COLLECTIVES_AGREE_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "dtensor/collectives/communicator.h"

namespace dtensor {

absl::Status AgreeOnStatus(Communicator& world, const absl::Status& mine, absl::string_view what);

absl::StatusOr<std::vector<std::string>> AllGatherText(Communicator& world, absl::string_view text);

// Every rank's `mine` (the same count on every rank), in rank order: one all_gather on the
// communicator's device (NCCL moves device tensors only); the result on the host.
absl::StatusOr<std::vector<int64_t>> AllGatherInts(Communicator& world, absl::Span<const int64_t> mine);

}  // namespace dtensor

#endif  // DTENSOR_COLLECTIVES_AGREE_H_
