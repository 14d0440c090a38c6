// hvdp: a shared-memory allreduce for ranks that share one host. See shm_operations.h.

#include "shm_operations.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <thread>
#include <type_traits>

#include "mpi.h"

#include "../global_state.h"
#include "../logging.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HVDP_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define HVDP_CPU_RELAX() asm volatile("yield")
#else
#define HVDP_CPU_RELAX() std::this_thread::yield()
#endif

namespace horovod {
namespace common {

namespace {

constexpr size_t kLine = 64;          // flags and parts sit on their own cache lines
constexpr int kSpinsBeforeYield = 4096;

static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "the barrier flags live in shared memory and must be lock-free");

struct Setup {  // what rank 0 tells the others
  char name[64];
  uint64_t chunk_bytes;
  double timeout_seconds;
  int ok;
};

// Chunks of half a core's L2 measured best here (256 KiB: 6.3 GB/s at 64 MiB); a chunk as large as the L2
// measured 4x slower, larger ones about 8% slower.
size_t DefaultChunkBytes() {
  long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  return l2 > 0 ? std::max<size_t>(static_cast<size_t>(l2) / 2, 64u << 10) : (256u << 10);
}

template <typename T>
using ScaleType = typename std::conditional<std::is_same<T, float>::value, float, double>::type;

// The sum in rank order of src[q][first + i] for every rank q, but for rank `own`, whose values come from
// `own_in` times `prescale` (as Horovod's ScaleBuffer computes it). The sum goes to `shared` for the peers,
// and times `postscale` to `out`.
template <typename T>
void SumInRankOrder(const std::vector<const T*>& src, size_t first, int own, const T* own_in, double prescale,
                    double postscale, T* shared, T* out, size_t count) {
  constexpr size_t kBlock = 1024;
  const auto pre = static_cast<ScaleType<T>>(prescale);
  const auto post = static_cast<ScaleType<T>>(postscale);
  T acc[kBlock], scaled[kBlock];
  for (size_t b = 0; b < count; b += kBlock) {
    const size_t m = std::min(kBlock, count - b);
    for (size_t q = 0; q < src.size(); ++q) {
      const T* s = static_cast<int>(q) == own ? own_in + b : src[q] + first + b;
      if (static_cast<int>(q) == own && prescale != 1.0) {
        // Scaled on its own, rounded, then added: as MPI's path computes it (no fused multiply-add).
        ScaleBufferCPUImpl(s, scaled, static_cast<int64_t>(m), pre);
        s = scaled;
      }
      if (q == 0) {
        std::memcpy(acc, s, m * sizeof(T));
      } else {
        for (size_t i = 0; i < m; ++i) acc[i] += s[i];
      }
    }
    std::memcpy(shared + b, acc, m * sizeof(T));
    if (postscale == 1.0) {
      std::memcpy(out + b, acc, m * sizeof(T));
    } else {
      for (size_t i = 0; i < m; ++i) out[b + i] = post * acc[i];
    }
  }
}

// Copies `bytes` from `from` to `to`, multiplied by `scale` unless it is 1 (as Horovod's ScaleBuffer does).
template <typename T>
void CopyScaled(const char* from, char* to, size_t bytes, double scale) {
  if (scale == 1.0) {
    std::memcpy(to, from, bytes);
  } else {
    ScaleBufferCPUImpl(reinterpret_cast<const T*>(from), reinterpret_cast<T*>(to),
                       static_cast<int64_t>(bytes / sizeof(T)), static_cast<ScaleType<T>>(scale));
  }
}

} // namespace

ShmAllreduce::ShmAllreduce(HorovodGlobalState* global_state)
    : AllreduceOp(global_state) {
  if (global_state->control_operation != LibType::MPI) {
    return;
  }
  auto& controller = *global_state->global_controller;
  rank_ = controller.GetRank();
  size_ = controller.GetSize();
  const char* env = std::getenv("HVDP_SHM_ALLREDUCE");
  bool asked = env != nullptr && std::strcmp(env, "1") == 0;
  int want = asked && size_ > 1 && controller.GetLocalSize() == size_ ? 1 : 0;
  MPI_Comm comm = global_state->process_set_table.Get(0).mpi_context.GetMPICommunicator(Communicator::GLOBAL);
  int all = 0;
  MPI_Allreduce(&want, &all, 1, MPI_INT, MPI_MIN, comm);
  if (!all) {
    if (asked && rank_ == 0) {
      LOG(INFO) << "hvdp: shared-memory allreduce off: it needs every rank on one host and "
                   "HVDP_SHM_ALLREDUCE=1 on every rank; MPI's allreduce is used";
    }
    return;
  }

  // The flags' cache lines, then two chunk slots per rank.
  auto segment_bytes = [this](size_t chunk) { return kLine * size_ + 2 * chunk * size_; };
  Setup setup{};
  int fd = -1;
  int error = 0;  // why this rank could not map the segment
  if (rank_ == 0) {
    const char* chunk_env = std::getenv("HVDP_SHM_CHUNK_BYTES");
    const char* timeout_env = std::getenv("HVDP_SHM_TIMEOUT_SECONDS");
    size_t chunk = chunk_env ? std::strtoull(chunk_env, nullptr, 10) : DefaultChunkBytes();
    setup.chunk_bytes = std::max<size_t>((chunk + kLine - 1) / kLine * kLine, kLine * size_);
    setup.timeout_seconds = timeout_env ? std::atof(timeout_env) : 60.0;
    std::snprintf(setup.name, sizeof(setup.name), "/hvdp-shm-%d-%lld", static_cast<int>(getpid()),
                  static_cast<long long>(std::chrono::steady_clock::now().time_since_epoch().count()));
    fd = shm_open(setup.name, O_CREAT | O_EXCL | O_RDWR, 0600);
    // posix_fallocate, not ftruncate: a /dev/shm too small for the segment (Docker's default is 64 MiB)
    // must fail here, not with SIGBUS in the middle of a step.
    error = fd >= 0 ? posix_fallocate(fd, 0, static_cast<off_t>(segment_bytes(setup.chunk_bytes))) : errno;
    setup.ok = error == 0;
  }
  MPI_Bcast(&setup, sizeof(setup), MPI_BYTE, 0, comm);
  chunk_bytes_ = setup.chunk_bytes;
  timeout_seconds_ = setup.timeout_seconds;
  mapping_bytes_ = segment_bytes(chunk_bytes_);
  int ok = setup.ok;
  if (ok && rank_ != 0) {
    fd = shm_open(setup.name, O_RDWR, 0600);
    ok = fd >= 0;
    error = ok ? 0 : errno;
  }
  if (ok) {
    mapping_ = mmap(nullptr, mapping_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ok = mapping_ != MAP_FAILED;
    if (!ok) {
      error = errno;
      mapping_ = nullptr;
    }
  }
  if (fd >= 0) {
    close(fd);
  }
  if (ok && rank_ == 0) {
    for (int p = 0; p < size_; ++p) {
      new (static_cast<char*>(mapping_) + kLine * p) std::atomic<uint64_t>(0);
    }
  }
  int all_ok = 0;
  MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, comm);  // everyone has mapped it (or given up) ...
  if (rank_ == 0 && setup.name[0] != '\0') {
    shm_unlink(setup.name);  // ... so the name can go: nothing is left behind, whatever happens next
  }
  if (!all_ok) {
    if (!ok && (rank_ == 0 || setup.ok)) {  // the rank that failed says why
      LOG(WARNING) << "hvdp: shared-memory allreduce off: rank " << rank_ << " could not map "
                   << mapping_bytes_ << " bytes of /dev/shm (" << std::strerror(error)
                   << "); MPI's allreduce is used. In Docker, give the container more with --shm-size.";
    }
    if (mapping_ != nullptr) {
      munmap(mapping_, mapping_bytes_);
      mapping_ = nullptr;
    }
    return;
  }
  flags_ = static_cast<char*>(mapping_);
  slots_ = static_cast<char*>(mapping_) + kLine * size_;
  enabled_ = true;
  if (rank_ == 0) {
    LOG(DEBUG) << "hvdp: shared-memory allreduce on for " << size_ << " ranks, chunk " << chunk_bytes_
               << " bytes";
  }
}

ShmAllreduce::~ShmAllreduce() {
  if (mapping_ != nullptr) {
    munmap(mapping_, mapping_bytes_);
  }
}

bool ShmAllreduce::Enabled(const ParameterManager& param_manager,
                           const std::vector<TensorTableEntry>& entries,
                           const Response& response) const {
  if (!enabled_ || entries[0].device != CPU_DEVICE_ID || entries[0].process_set_id != 0) {
    return false;
  }
  if (response.reduce_op() != ReduceOp::SUM && response.reduce_op() != ReduceOp::AVERAGE) {
    return false;
  }
  switch (entries[0].tensor->dtype()) {
  case HOROVOD_FLOAT32:
  case HOROVOD_FLOAT64:
  case HOROVOD_INT32:
  case HOROVOD_INT64:
    return true;
  default:
    return false;  // float16 and the rest: MPI's allreduce
  }
}

std::atomic<uint64_t>& ShmAllreduce::Flag(int rank) const {
  return *reinterpret_cast<std::atomic<uint64_t>*>(flags_ + kLine * rank);
}

char* ShmAllreduce::Slot(int rank, int which) const {
  return slots_ + (static_cast<size_t>(rank) * 2 + which) * chunk_bytes_;
}

void ShmAllreduce::Barrier(const char* phase, const std::string& tensor) {
  ++generation_;
  Flag(rank_).store(generation_, std::memory_order_release);
  for (int p = 0; p < size_; ++p) {
    std::atomic<uint64_t>& flag = Flag(p);
    long spins = 0;
    std::chrono::steady_clock::time_point since;
    while (flag.load(std::memory_order_acquire) < generation_) {
      if (++spins < kSpinsBeforeYield) {
        HVDP_CPU_RELAX();
        continue;
      }
      if (spins == kSpinsBeforeYield) {
        since = std::chrono::steady_clock::now();
      }
      std::this_thread::yield();
      if (spins % 1024 == 0 &&
          std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count() > timeout_seconds_) {
        broken_ = true;
        throw std::runtime_error(
            "hvdp shared-memory allreduce: rank " + std::to_string(p) + " did not reach the " + phase +
            " step of '" + tensor + "' within " + std::to_string(static_cast<int>(timeout_seconds_)) +
            " s (rank " + std::to_string(rank_) + " waited for it): it died, hangs or is stopped. "
            "HVDP_SHM_TIMEOUT_SECONDS sets this limit; HVDP_SHM_ALLREDUCE=0 uses MPI's allreduce instead.");
      }
    }
  }
}

// Calls fn(piece, offset in the piece, offset in the buffer, bytes) for each piece's share of the buffer's
// bytes [begin, end); `starts` holds each piece's offset in the buffer.
template <typename F>
void ForEachPiece(const std::vector<ShmAllreduce::Piece>& pieces, const std::vector<size_t>& starts,
                  size_t begin, size_t end, F fn) {
  size_t i = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
  for (; begin < end; ++i) {
    const size_t at = begin - starts[i];
    const size_t n = std::min(pieces[i].bytes - at, end - begin);
    fn(pieces[i], at, begin, n);
    begin += n;
  }
}

template <typename T>
void ShmAllreduce::Run(const std::vector<Piece>& pieces, size_t total_bytes, double prescale,
                       double postscale, const std::string& tensor) {
  std::vector<size_t> starts(pieces.size());
  for (size_t i = 0, at = 0; i < pieces.size(); at += pieces[i].bytes, ++i) {
    starts[i] = at;
  }
  const size_t line_elems = kLine / sizeof(T);
  std::vector<const T*> sources(size_);
  for (size_t done = 0, k = 0; done < total_bytes; ++k) {
    const size_t m = std::min(chunk_bytes_, total_bytes - done);
    const int which = static_cast<int>(k & 1);
    char* mine = Slot(rank_, which);
    // Rank p reduces part p of the chunk: whole cache lines, so no two ranks write the same line.
    const size_t elems = m / sizeof(T);
    const size_t part = ((elems + size_ - 1) / size_ + line_elems - 1) / line_elems * line_elems;
    auto part_begin = [&](int p) { return std::min(part * p, elems) * sizeof(T); };
    const size_t lo = part_begin(rank_), hi = part_begin(rank_ + 1);

    // 1. The peers' parts of this rank's input into its slot (its own part it reads in place, in 2).
    auto copy_in = [&](const Piece& piece, size_t at, size_t offset, size_t n) {
      CopyScaled<T>(piece.in + at, mine + (offset - done), n, prescale);
    };
    ForEachPiece(pieces, starts, done, done + lo, copy_in);
    ForEachPiece(pieces, starts, done + hi, done + m, copy_in);
    Barrier("copy-in", tensor);

    // 2. This rank's part: the sum over all ranks, into its slot for the peers and scaled into its output.
    for (int p = 0; p < size_; ++p) {
      sources[p] = reinterpret_cast<const T*>(Slot(p, which));
    }
    ForEachPiece(pieces, starts, done + lo, done + hi, [&](const Piece& piece, size_t at, size_t offset, size_t n) {
      const size_t first = (offset - done) / sizeof(T);
      SumInRankOrder(sources, first, rank_, reinterpret_cast<const T*>(piece.in + at), prescale, postscale,
                     reinterpret_cast<T*>(mine) + first, reinterpret_cast<T*>(piece.out + at), n / sizeof(T));
    });
    Barrier("reduce", tensor);

    // 3. The peers' parts, reduced by each of them, into this rank's output.
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      const char* from = Slot(p, which);
      ForEachPiece(pieces, starts, done + part_begin(p), done + part_begin(p + 1),
                   [&](const Piece& piece, size_t at, size_t offset, size_t n) {
                     CopyScaled<T>(from + (offset - done), piece.out + at, n, postscale);
                   });
    }
    done += m;
  }
}

Status ShmAllreduce::Execute(std::vector<TensorTableEntry>& entries, const Response& response) {
  WaitForData(entries);
  const std::string& tensor = entries[0].tensor_name;
  if (broken_) {
    throw std::runtime_error("hvdp shared-memory allreduce: a peer failed an earlier allreduce; '" +
                             tensor + "' cannot be reduced");
  }
  double prescale = response.prescale_factor();
  double postscale = response.postscale_factor();
  if (response.reduce_op() == ReduceOp::AVERAGE) {
    postscale /= size_;  // as MPIAllreduce does
  }
  std::vector<Piece> pieces;
  size_t total = 0;
  for (auto& e : entries) {
    size_t bytes = static_cast<size_t>(e.tensor->size());
    if (bytes > 0) {
      pieces.push_back({static_cast<const char*>(e.tensor->data()),
                        static_cast<char*>(const_cast<void*>(e.output->data())), bytes});
      total += bytes;
    }
  }
  auto& timeline = global_state_->timeline;
  timeline.ActivityStartAll(entries, "SHM_ALLREDUCE");
  switch (entries[0].tensor->dtype()) {
  case HOROVOD_FLOAT32:
    Run<float>(pieces, total, prescale, postscale, tensor);
    break;
  case HOROVOD_FLOAT64:
    Run<double>(pieces, total, prescale, postscale, tensor);
    break;
  case HOROVOD_INT32:
    Run<int32_t>(pieces, total, prescale, postscale, tensor);
    break;
  case HOROVOD_INT64:
    Run<int64_t>(pieces, total, prescale, postscale, tensor);
    break;
  default:
    throw std::logic_error("hvdp shared-memory allreduce: unsupported type " +
                           DataType_Name(entries[0].tensor->dtype()));
  }
  timeline.ActivityEndAll(entries);
  return Status::OK();
}

} // namespace common
} // namespace horovod
