// hvdp: a shared-memory allreduce for ranks that share one host, added to Horovod 0.28.1's CPU operations
// by docker/build_horovod.sh. Off unless HVDP_SHM_ALLREDUCE=1 (hvdp's runtime defaults set it); see the
// README's "Benchmarks" for why it exists and what it measured.
//
// The ranks map one segment of /dev/shm holding two chunk slots per rank. A buffer (one tensor, or the
// tensors of a fused response, which skip Horovod's fusion buffer) goes through in chunks of half an L2,
// so the slots stay in cache and the buffer itself is read once and written once, like a memcpy. For each
// chunk, rank r (of n) owns the r-th 1/n of it, on whole cache lines:
//   1. it copies the other ranks' parts of its input into its slot;            barrier
//   2. it sums its part over all ranks in rank order (its own input read in place), into its slot and
//      into its output;                                                         barrier
//   3. it copies every other rank's summed part from that rank's slot into its output.
// The slots alternate between chunks, so a chunk's copy-in never overwrites a slot a slower peer is still
// reading. Every rank gets the same bits, and with 2 ranks the same bits as MPI's allreduce.
// Scaling (prescale, postscale, average) is applied while copying, as Horovod's ScaleBuffer computes it.

#ifndef HVDP_SHM_OPERATIONS_H
#define HVDP_SHM_OPERATIONS_H

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "collective_operations.h"

namespace horovod {
namespace common {

class ShmAllreduce : public AllreduceOp {
public:
  // Collective over the global MPI communicator: every rank must construct it, in the same order.
  explicit ShmAllreduce(HorovodGlobalState* global_state);
  ~ShmAllreduce() override;

  Status Execute(std::vector<TensorTableEntry>& entries,
                 const Response& response) override;

  bool Enabled(const ParameterManager& param_manager,
               const std::vector<TensorTableEntry>& entries,
               const Response& response) const override;

  struct Piece {  // one tensor's bytes within the buffer the chunks walk through
    const char* in;
    char* out;
    size_t bytes;
  };

private:
  void Barrier(const char* phase, const std::string& tensor);
  std::atomic<uint64_t>& Flag(int rank) const;
  char* Slot(int rank, int which) const;
  template <typename T>
  void Run(const std::vector<Piece>& pieces, size_t total_bytes, double prescale, double postscale,
           const std::string& tensor);

  int rank_ = 0;
  int size_ = 1;
  bool enabled_ = false;
  bool broken_ = false;
  size_t chunk_bytes_ = 0;
  double timeout_seconds_ = 60;
  uint64_t generation_ = 0;
  void* mapping_ = nullptr;
  size_t mapping_bytes_ = 0;
  char* flags_ = nullptr;  // one std::atomic<uint64_t> per rank, a cache line apart
  char* slots_ = nullptr;
};

} // namespace common
} // namespace horovod

#endif // HVDP_SHM_OPERATIONS_H
