// Distributed checkpoints that reshard on load (PyTorch DCP's model): every rank writes the
// pieces of the state it owns into one file of its own, rank 0 adds one metadata file, and a
// load onto any meshes and layouts (another parallelism, another world size) reads, on each
// rank, only the byte ranges that overlap the pieces it needs.
//
//   CheckpointState state = {{"wte", wte_dtensor}, {"step", step_tensor}};
//   DT_RETURN_IF_ERROR(SaveCheckpoint(world, "/ckpt", "step-00000010", state, {.keep = 3}));
//   ...                                      // later, maybe on another mesh and layouts:
//   DT_ASSIGN_OR_RETURN(std::string dir, LatestCheckpoint("/ckpt"));   // "/ckpt/step-00000010"
//   DT_RETURN_IF_ERROR(LoadCheckpoint(dir, target));   // fills target's tensors in place
//
// A state is named tensors: DTensors (any mesh, any layout: Shard, Replicate, Partial, nested
// shard orders, uneven torch.chunk pieces) and plain Tensors (every rank holds the same value;
// rank 0 writes it). What is written: for each DTensor, each distinct piece once (a
// Replicate piece by the rank at coordinate 0 of the replicating mesh dims; Partial values
// are reduced first, a collective), as raw little-endian bytes, row-major, appended to
// rank-<r>.bin; and metadata.json (nlohmann-json): per tensor its global shape and dtype, per
// piece its box (offset and shape in the global tensor), file, byte offset, length and the
// CRC-32 (zlib) of each block of `block_bytes`.
//
// Atomic and crash-safe: the pieces go to a directory of this save's own,
// <root>/.tmp-<name>.<16 random hex digits>/ (made by rank 0, which holds an flock on it
// until the save ends), are fsynced, rank 0 writes the metadata last (fsynced, renamed into
// place), then renames the directory to <root>/<name> only if that does not exist
// (RENAME_NOREPLACE) and fsyncs <root>. A checkpoint directory without metadata.json is never
// picked, and a save interrupted at any moment leaves the previous checkpoints as they were
// (its .tmp- directory is removed when it fails, or, after a crash, by the next save of the
// series up to its name that commits; a directory a live save holds is never removed, where
// the filesystem has flock). Two saves of one name into one root at the same time (two jobs)
// do not mix: one commits, the other returns AlreadyExists and prunes nothing.
// <root> is taken normalised ("ckpt/" and "ckpt" are one root); missing directories on its
// path are made as MakeCheckpointRoot makes them.
// Every rank writes to the same directory: one host, or a filesystem all hosts share (as DCP).
//
// Load: for each target tensor, this rank's box (LocalBoxOf of its layout) is filled from the
// stored pieces that overlap it: whole checksum blocks are read (pread) and verified, and
// only blocks holding some of the box's bytes. A Partial target is filled as R -> P is:
// Partial(sum) holds the value on the rank at coordinate 0 of the partial mesh dims and zeros
// elsewhere; avg, max and min hold it everywhere.
//
// Errors, each naming the tensor and the file: a tensor missing from the checkpoint, a global
// shape or dtype that differs from the target's, a missing or truncated file, a checksum
// mismatch, pieces that do not cover the target (DataLoss); never a crash or silently wrong
// values. A load checks every target against the metadata before it reads a byte, so those
// errors change no target; an error found in reading (a checksum, a cut file) may leave the
// targets before it loaded. A save refuses (InvalidArgument, nothing committed) a name given
// twice and a tensor the ranks' pieces do not cover exactly (a rank that leaves a sharded
// tensor out, ranks that give it different layouts). A rank's failure during a save becomes
// every rank's error (the ranks agree before the metadata is written).
#ifndef DTENSOR_CHECKPOINT_CHECKPOINT_H_
#define DTENSOR_CHECKPOINT_CHECKPOINT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "dtensor/collectives/communicator.h"
#include "dtensor/core/dtensor.h"
#include "dtensor/tensor/tensor.h"

namespace dtensor {

// A DTensor, or a plain Tensor every rank holds whole.
using StateTensor = std::variant<DTensor, Tensor>;

struct StateEntry {
  std::string name = "";
  StateTensor tensor = Tensor();
  // The shape it is stored in, when that differs from the tensor's: the tensor's with dims 0
  // and 1 merged ([3, C, C] stored as [3C, C]: GPT-2's fused c_attn, which tensor parallelism
  // views stacked). Boxes map across (one box of the view is a box per index of its dim 0),
  // so a checkpoint saved in either view loads into the other.
  std::vector<int64_t> stored_shape = {};
};
using CheckpointState = std::vector<StateEntry>;

struct SaveOptions {
  // Then keep `keep` complete checkpoints of this name's series (0: all): this one and the
  // newest before it of the same form, digits aside (step-00000010: step-<digits>), ordered as
  // LatestCheckpoint orders them; those after it (another run's) and other names ("best") are
  // left alone.
  int64_t keep = 0;
  int64_t block_bytes = 1 << 20;  // checksum granularity (and the reader's unit)
};

// Saves `state` as <root>/<name>. Collective over `world` (every rank that holds any of the
// DTensors, each with the same names in the same order). <root>/<name> must not exist
// (AlreadyExists, also when another save commits it first).
absl::Status SaveCheckpoint(Communicator& world, const std::string& root, const std::string& name,
                            const CheckpointState& state, const SaveOptions& options = {});

// Makes `root` a directory, with every missing directory on its path (as mkdir -p; `root`
// normalised lexically, a trailing '/' aside), and makes each one it made durable: the
// directory holding it is fsynced after it, up to the first that existed, so that a power
// loss after a save cannot lose the root and every checkpoint in it. A directory that
// another process makes meanwhile is taken as it is. FailedPrecondition when `root` is not a
// directory (a file's path); Internal naming the path for an error of the filesystem.
// SaveCheckpoint calls it; a caller that wants the root before its first save (to check it
// is writable) calls it too.
absl::Status MakeCheckpointRoot(const std::string& root);

// The newest complete checkpoint under `root` (by name, runs of digits compared as numbers:
// step-100000000 after step-99999999), as a path; NotFound when there is none.
absl::StatusOr<std::string> LatestCheckpoint(const std::string& root);

// A save whose files are written by a background thread while training goes on (the trainer's
// --ckpt-async): Start stages this rank's pieces in host memory (a copy: training may change
// the tensors at once; collective, as Partial values are reduced; pieces on a GPU are copied
// into pinned memory, Tensor::EmptyPinned, which stays cached for the next save) and returns; Finish waits
// for the files and commits (collective: every rank calls it, before the next save to the same
// root commits, in order; gpt_train finishes each before the next: a commit removes the .tmp-
// directories of earlier names of its series that no live save holds, and where the
// filesystem has no flock, an unfinished save's too).
// Until Finish the checkpoint is incomplete: a crash leaves the previous one. Destroying an
// unfinished save waits for its thread and commits nothing.
class AsyncCheckpointSave {
 public:
  static absl::StatusOr<std::unique_ptr<AsyncCheckpointSave>> Start(Communicator& world, const std::string& root,
                                                                    const std::string& name,
                                                                    const CheckpointState& state,
                                                                    const SaveOptions& options = {});
  absl::Status Finish();
  ~AsyncCheckpointSave();
  AsyncCheckpointSave(const AsyncCheckpointSave&) = delete;
  AsyncCheckpointSave& operator=(const AsyncCheckpointSave&) = delete;

  struct Job;  // internal (checkpoint.cc)

 private:
  AsyncCheckpointSave();
  std::unique_ptr<Job> job_;
  std::thread thread_;
  bool finished_ = false;
};

struct LoadStats {
  int64_t bytes_read = 0;  // by this rank
  int64_t files_opened = 0;
};

// What a checkpoint holds: each tensor's name, global shape (as stored) and dtype, in the
// metadata's order (for a caller that checks its state against it first, e.g. a model of
// another size). NotFound / DataLoss as LoadCheckpoint.
struct CheckpointTensor {
  std::string name = "";
  Shape shape = {};
  DType dtype = DType::kFloat32;
};
absl::StatusOr<std::vector<CheckpointTensor>> CheckpointTensors(const std::string& dir);

// Fills every tensor of `state` (DTensors: this rank's local tensor; Tensors: whole) from the
// checkpoint directory `dir`, resharding to the targets' meshes and layouts. Not collective.
absl::Status LoadCheckpoint(const std::string& dir, const CheckpointState& state, LoadStats* stats = nullptr);

}  // namespace dtensor

#endif  // DTENSOR_CHECKPOINT_CHECKPOINT_H_
