// hvdp: a shared-memory allreduce for ranks that share one host, added to Horovod 0.28.1's CPU operations
// by scripts/build_horovod.sh. Off unless HVDP_SHM_ALLREDUCE=1 (hvdp's runtime defaults set it); see
// docs/internals.md for how it works and docs/benchmarks.md for what it measured.
//
// The ranks map one segment of /dev/shm holding one cache line of barrier words and two chunk slots per
// rank. The segment never has a name: rank 0 creates it with O_TMPFILE and the others open its descriptor
// through /proc, so nothing is left in /dev/shm whichever rank dies at whichever point. A barrier's
// timeout (HVDP_SHM_TIMEOUT_SECONDS) does not count the time its own process was paused (SIGSTOP, a
// suspended job). A buffer (one tensor, or the tensors of a fused response, which skip Horovod's fusion buffer) goes
// through in chunks of half an L2, so the slots stay in cache and the buffer itself is read once and
// written once, like a memcpy. For each chunk, rank r (of n) owns the r-th 1/n of it, on whole cache lines:
//   1. it copies the other ranks' parts of its input into its slot;            barrier
//   2. it sums its part over all ranks in rank order (its own input read in place), scaled, into its slot
//      and into its output;                                                     barrier
//   3. it copies every other rank's finished part from that rank's slot into its output.
// The slots alternate with every chunk the op runs, across responses too, so a chunk's copy-in never
// overwrites a slot a slower peer is still reading: a rank writes slot s again only after the barrier of
// the chunk in between, which every peer reaches only after step 3 of the chunk that last used s.
// Every rank gets the same bits, and with 2 ranks the same bits as MPI's allreduce.
// Types: float32, float64, int32 and int64 scale as Horovod's ScaleBuffer does (each input scaled and
// rounded, then added); float16 and bfloat16 are widened to float32, scaled, summed in rank order, scaled
// and rounded once. A barrier spins for 50 us, then sleeps on a futex, so a rank never holds a core that a
// late peer needs.

#ifndef HVDP_SHM_OPERATIONS_H
#define HVDP_SHM_OPERATIONS_H

#include <atomic>
#include <chrono>
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
  struct RankLine;

private:
  void Barrier(const char* phase, const std::string& tensor);
  void Sleep(RankLine& peer, int p, std::chrono::steady_clock::time_point since, const char* phase,
             const std::string& tensor);
  RankLine& Line(int rank) const;
  char* Slot(int rank, int which) const;
  template <typename Tr>
  void Run(const std::vector<Piece>& pieces, size_t total_bytes, double prescale, double postscale,
           const std::string& tensor);

  int rank_ = 0;
  int size_ = 1;
  bool enabled_ = false;
  bool broken_ = false;
  size_t chunk_bytes_ = 0;
  double timeout_seconds_ = 60;
  uint64_t generation_ = 0;
  uint64_t chunks_ = 0;  // chunks run so far, by every response: chunk k uses slot k & 1
  void* mapping_ = nullptr;
  size_t mapping_bytes_ = 0;
  char* flags_ = nullptr;  // one RankLine per rank, a cache line apart
  char* slots_ = nullptr;
};

} // namespace common
} // namespace horovod

#endif // HVDP_SHM_OPERATIONS_H
