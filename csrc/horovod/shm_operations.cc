// hvdp: a shared-memory allreduce for ranks that share one host. See shm_operations.h.

#include "shm_operations.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <type_traits>

#include "mpi.h"

#include "../bfloat16.h"
#include "../global_state.h"
#include "../half.h"
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

constexpr size_t kLine = 64;  // each rank's barrier word and each part sit on their own cache lines
// How long a rank spins on a peer's barrier word before it sleeps on it (a futex). Ranks that arrive
// together meet within a few microseconds; a peer that is later than this is descheduled or busy, and
// spinning on would take the core it needs (on a host with as many ranks as cores, the usual case).
constexpr auto kSpin = std::chrono::microseconds(50);
constexpr long kSleepNanos = 100 * 1000 * 1000;  // a sleeper wakes this often to check the timeout
// A sleeper whose clock jumped by more than this between two wake-ups (100 ms apart) was itself paused: its
// process stopped (SIGSTOP, a suspended job, a paused VM). Its peers were paused too, or they will time out
// on it; it gives the peer it waits for a fresh timeout from the resume.
constexpr auto kPauseGap = std::chrono::seconds(2);

static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free,
              "the barrier words live in shared memory and must be lock-free");

struct Setup {  // what rank 0 tells the others
  uint64_t chunk_bytes;
  double timeout_seconds;
  int64_t pid;   // rank 0's process ...
  int fd;        // ... and its descriptor of the segment: the others open /proc/<pid>/fd/<fd>
  uint64_t dev;  // the segment's device and inode, which the others check they opened
  uint64_t ino;
  int ok;
};

// Test hook (tests/faults/test_shm_cleanup.py): HVDP_SHM_KILL_AT="<point>:<rank>" kills that rank with SIGKILL
// at that point of the set-up or use, to show that no point leaves anything in /dev/shm.
void KillAt(const char* point, int rank) {
  static const std::string at = std::getenv("HVDP_SHM_KILL_AT") ? std::getenv("HVDP_SHM_KILL_AT") : "";
  if (!at.empty() && at == std::string(point) + ":" + std::to_string(rank)) {
    raise(SIGKILL);
  }
}

// The segment, a file with no name: on /dev/shm's tmpfs (so its size limit applies, as it does to
// shm_open), created unnamed with O_TMPFILE. Nothing can be left in /dev/shm whatever dies when: the file
// goes with the last descriptor or mapping. A kernel without O_TMPFILE on tmpfs gets a named file unlinked
// at once (a window of one system call). Returns the descriptor, or -1 with errno set.
int CreateSegment(int rank) {
  int fd = open("/dev/shm", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd >= 0 || (errno != EOPNOTSUPP && errno != EISDIR && errno != EINVAL)) {
    return fd;
  }
  char name[64];
  std::snprintf(name, sizeof(name), "/hvdp-shm-%d-%lld", static_cast<int>(getpid()),
                static_cast<long long>(std::chrono::steady_clock::now().time_since_epoch().count()));
  fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd >= 0) {
    KillAt("named", rank);
    shm_unlink(name);
  }
  return fd;
}

// 256 KiB chunks measured best on both machines this ran on, whatever their L2: 6.3 GB/s at 64 MiB with a
// 512 KiB L2 (a chunk as large as the L2 was 4x slower), and 8.0 against 7.5 GB/s at 64 MiB and 9.0 against
// 5.7 at 16 MiB for the 1 MiB that half the L2 gave with a 2 MiB L2 (four interleaved launches each).
constexpr size_t kDefaultChunkBytes = 256u << 10;

// The value of environment variable `name` if it is a number in [low, high] (a whole number if `whole`),
// else `fallback`, with a warning that names the variable, the value and what is used instead.
double EnvNumber(const char* name, double fallback, double low, double high, bool whole, const char* unit) {
  const char* text = std::getenv(name);
  if (text == nullptr) {
    return fallback;
  }
  char* end = nullptr;
  errno = 0;
  double value = std::strtod(text, &end);
  bool ok = end != text && *end == '\0' && errno == 0 && std::isfinite(value) && value >= low &&
            value <= high && (!whole || value == std::floor(value));
  if (!ok) {
    LOG(WARNING) << "hvdp: " << name << "='" << text << "' is not " << (whole ? "a whole number of " : "a number of ")
                 << unit << " between " << low << " and " << high << "; using " << fallback << " instead";
    return fallback;
  }
  return value;
}

long Futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  // Not FUTEX_PRIVATE_FLAG: the word is shared between processes.
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

// How each element type is reduced: Acc is the type the sum is kept in; Widen and Narrow convert an
// element to it and back. Scaling follows Horovod's ScaleBuffer for the 32- and 64-bit types (an input is
// scaled, rounded to its type, then added); the 16-bit types are widened to float32, scaled, summed and
// scaled there, and rounded once.
template <typename T>
struct Plain {
  using Storage = T;
  using Acc = T;
  using Scale = typename std::conditional<std::is_same<T, float>::value, float, double>::type;
  static constexpr bool kRoundEachInput = true;
  static Acc Widen(T v) { return v; }
  static T Narrow(Acc a) { return a; }
};
struct Float16 {
  using Storage = uint16_t;
  using Acc = float;
  using Scale = float;
  static constexpr bool kRoundEachInput = false;
  static Acc Widen(uint16_t v) {
    float f;
    HalfBits2Float(&v, &f);
    return f;
  }
  static uint16_t Narrow(Acc a) {
    uint16_t h;
    Float2HalfBits(&a, &h);
    return h;
  }
};
struct BFloat16Type {
  using Storage = uint16_t;
  using Acc = float;
  using Scale = float;
  static constexpr bool kRoundEachInput = false;
  static Acc Widen(uint16_t v) { return BFloat16ToFloat(v); }
  static uint16_t Narrow(Acc a) { return FloatToBFloat16(a); }
};

// The sum in rank order of src[q][first + i] for every rank q, but for rank `own`, whose values are read
// from `own_in` (its input, in place); each input times `prescale`, the sum times `postscale`. The result
// goes to `shared` for the peers and to `out`: the same bits for every rank.
template <typename Tr>
void ReduceInRankOrder(const std::vector<const typename Tr::Storage*>& src, size_t first, int own,
                       const typename Tr::Storage* own_in, double prescale, double postscale,
                       typename Tr::Storage* shared, typename Tr::Storage* out, size_t count) {
  using T = typename Tr::Storage;
  using Acc = typename Tr::Acc;
  constexpr size_t kBlock = 1024;
  const auto pre = static_cast<typename Tr::Scale>(prescale);
  const auto post = static_cast<typename Tr::Scale>(postscale);
  Acc acc[kBlock], scaled[kBlock];
  for (size_t b = 0; b < count; b += kBlock) {
    const size_t m = std::min(kBlock, count - b);
    for (size_t q = 0; q < src.size(); ++q) {
      const T* s = static_cast<int>(q) == own ? own_in + b : src[q] + first + b;
      if (prescale == 1.0) {
        if (q == 0) {
          for (size_t i = 0; i < m; ++i) acc[i] = Tr::Widen(s[i]);
        } else {
          for (size_t i = 0; i < m; ++i) acc[i] += Tr::Widen(s[i]);
        }
      } else {
        // Scaled in a loop of its own, then added: as MPI's path computes it. In one expression the
        // compiler would fuse the multiply and the add (-mfma), which rounds once where MPI rounds twice.
        for (size_t i = 0; i < m; ++i) {
          scaled[i] = Tr::kRoundEachInput ? static_cast<Acc>(static_cast<T>(pre * Tr::Widen(s[i])))
                                          : static_cast<Acc>(pre * Tr::Widen(s[i]));
        }
        if (q == 0) {
          std::memcpy(acc, scaled, m * sizeof(Acc));
        } else {
          for (size_t i = 0; i < m; ++i) acc[i] += scaled[i];
        }
      }
    }
    T* to = out + b;
    if (postscale == 1.0) {
      for (size_t i = 0; i < m; ++i) to[i] = Tr::Narrow(acc[i]);
    } else {
      for (size_t i = 0; i < m; ++i) to[i] = Tr::Narrow(static_cast<Acc>(post * acc[i]));
    }
    std::memcpy(shared + b, to, m * sizeof(T));
  }
}

} // namespace

// One cache line per rank in the segment: its barrier generation, and a futex word peers sleep on.
struct ShmAllreduce::RankLine {
  std::atomic<uint64_t> generation;
  std::atomic<uint32_t> wake;      // the low half of `generation`, stored after it
  std::atomic<uint32_t> sleepers;  // peers asleep (or about to sleep) on `wake`
};
static_assert(sizeof(ShmAllreduce::RankLine) <= kLine, "a rank's barrier words fit one cache line");

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
    // Checked here for raw Horovod users; hvdp's init() refuses a bad value before Horovod starts.
    auto chunk = static_cast<size_t>(EnvNumber("HVDP_SHM_CHUNK_BYTES", static_cast<double>(kDefaultChunkBytes),
                                               1, static_cast<double>(1ull << 40), true, "bytes"));
    setup.chunk_bytes = std::max<size_t>((chunk + kLine - 1) / kLine * kLine, kLine * size_);
    setup.timeout_seconds = EnvNumber("HVDP_SHM_TIMEOUT_SECONDS", 60.0, 0.001, 1e9, false, "seconds");
    fd = CreateSegment(rank_);
    KillAt("created", rank_);
    // posix_fallocate, not ftruncate: a /dev/shm too small for the segment (Docker's default is 64 MiB)
    // must fail here, not with SIGBUS in the middle of a step.
    error = fd >= 0 ? posix_fallocate(fd, 0, static_cast<off_t>(segment_bytes(setup.chunk_bytes))) : errno;
    struct stat st {};
    if (error == 0 && fstat(fd, &st) != 0) {
      error = errno;
    }
    setup.ok = error == 0;
    setup.pid = getpid();
    setup.fd = fd;
    setup.dev = st.st_dev;
    setup.ino = st.st_ino;
    KillAt("allocated", rank_);
  }
  MPI_Bcast(&setup, sizeof(setup), MPI_BYTE, 0, comm);
  chunk_bytes_ = setup.chunk_bytes;
  timeout_seconds_ = setup.timeout_seconds;
  mapping_bytes_ = segment_bytes(chunk_bytes_);
  int ok = setup.ok;
  if (ok && rank_ != 0) {
    // Rank 0's descriptor, reopened through /proc: it needs this user's access to rank 0's process, and it
    // must be the very file rank 0 made (ranks in another PID namespace would reach another process).
    const std::string path = "/proc/" + std::to_string(setup.pid) + "/fd/" + std::to_string(setup.fd);
    fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    struct stat st {};
    ok = fd >= 0 && fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_dev) == setup.dev &&
         static_cast<uint64_t>(st.st_ino) == setup.ino &&
         static_cast<size_t>(st.st_size) == mapping_bytes_;
    error = ok ? 0 : (fd >= 0 ? EXDEV : errno);  // EXDEV: another file than rank 0's
    KillAt("opened", rank_);
  }
  if (ok) {
    mapping_ = mmap(nullptr, mapping_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ok = mapping_ != MAP_FAILED;
    if (!ok) {
      error = errno;
      mapping_ = nullptr;
    }
  }
  if (ok && rank_ == 0) {
    for (int p = 0; p < size_; ++p) {
      auto* line = new (static_cast<char*>(mapping_) + kLine * p) RankLine;
      line->generation.store(0);
      line->wake.store(0);
      line->sleepers.store(0);
    }
  }
  KillAt("mapped", rank_);
  int all_ok = 0;
  MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, comm);  // everyone has mapped it (or given up) ...
  if (fd >= 0) {
    close(fd);  // ... so rank 0's descriptor can go: the mappings keep the segment, and nothing else does
  }
  KillAt("handshake", rank_);
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
  case HOROVOD_FLOAT16:
  case HOROVOD_BFLOAT16:
  case HOROVOD_FLOAT32:
  case HOROVOD_FLOAT64:
  case HOROVOD_INT32:
  case HOROVOD_INT64:
    return true;
  default:
    return false;  // int8, uint8, int16, bool: MPI's allreduce
  }
}

ShmAllreduce::RankLine& ShmAllreduce::Line(int rank) const {
  return *reinterpret_cast<RankLine*>(flags_ + kLine * rank);
}

char* ShmAllreduce::Slot(int rank, int which) const {
  return slots_ + (static_cast<size_t>(rank) * 2 + which) * chunk_bytes_;
}

// Every rank raises its generation, then waits until every peer's is as high: spinning for kSpin, then
// asleep on the peer's futex word, which the peer wakes when it arrives and sees a sleeper. (The sleeper
// counts itself before it reads the generation, the arriving rank publishes its generation before it reads
// the count, all sequentially consistent: one of the two always sees the other.)
void ShmAllreduce::Barrier(const char* phase, const std::string& tensor) {
  KillAt("in-use", rank_);
  ++generation_;
  RankLine& me = Line(rank_);
  me.generation.store(generation_);
  me.wake.store(static_cast<uint32_t>(generation_));
  if (me.sleepers.load() > 0) {
    Futex(&me.wake, FUTEX_WAKE, INT_MAX, nullptr);
  }
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) {
      continue;
    }
    RankLine& peer = Line(p);
    if (peer.generation.load(std::memory_order_acquire) >= generation_) {
      continue;
    }
    const auto since = std::chrono::steady_clock::now();
    for (int spins = 1; peer.generation.load(std::memory_order_acquire) < generation_; ++spins) {
      HVDP_CPU_RELAX();
      if (spins % 64 == 0 && std::chrono::steady_clock::now() - since > kSpin) {
        Sleep(peer, p, since, phase, tensor);
        break;
      }
    }
  }
}

void ShmAllreduce::Sleep(RankLine& peer, int p, std::chrono::steady_clock::time_point since, const char* phase,
                         const std::string& tensor) {
  peer.sleepers.fetch_add(1);
  auto last = std::chrono::steady_clock::now();
  if (last - since > kPauseGap) {
    since = last;  // paused while it spun
  }
  while (true) {
    const uint32_t seen = peer.wake.load();
    if (peer.generation.load() >= generation_) {
      break;
    }
    const timespec nap{0, kSleepNanos};
    Futex(&peer.wake, FUTEX_WAIT, seen, &nap);
    const auto now = std::chrono::steady_clock::now();
    if (now - last > kPauseGap) {
      since = now;  // this process was paused: the time it was stopped is not the peer's lateness
    }
    last = now;
    if (peer.generation.load() < generation_ &&
        std::chrono::duration<double>(now - since).count() > timeout_seconds_) {
      peer.sleepers.fetch_sub(1);
      broken_ = true;
      std::ostringstream seconds;  // 2, 0.5: as the user wrote it, not 2.000000
      seconds << timeout_seconds_;
      throw std::runtime_error(
          "hvdp shared-memory allreduce: rank " + std::to_string(p) + " did not reach the " + phase +
          " step of '" + tensor + "' within " + seconds.str() + " s (rank " +
          std::to_string(rank_) + " waited for it): it died, hangs or is stopped. "
          "HVDP_SHM_TIMEOUT_SECONDS sets this limit; HVDP_SHM_ALLREDUCE=0 uses MPI's allreduce instead.");
    }
  }
  peer.sleepers.fetch_sub(1);
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

template <typename Tr>
void ShmAllreduce::Run(const std::vector<Piece>& pieces, size_t total_bytes, double prescale,
                       double postscale, const std::string& tensor) {
  using T = typename Tr::Storage;
  std::vector<size_t> starts(pieces.size());
  for (size_t i = 0, at = 0; i < pieces.size(); at += pieces[i].bytes, ++i) {
    starts[i] = at;
  }
  const size_t line_elems = kLine / sizeof(T);
  std::vector<const T*> sources(size_);
  for (size_t done = 0; done < total_bytes;) {
    const size_t m = std::min(chunk_bytes_, total_bytes - done);
    // The slots alternate with every chunk this op has ever run, not only within one response: a fast rank
    // may start the next response (Horovod runs a cycle's responses back to back) while a slower one still
    // reads the last chunk's slots in step 3, and the next chunk's parts need not have the same bounds.
    const int which = static_cast<int>(chunks_++ & 1);
    char* mine = Slot(rank_, which);
    // Rank p reduces part p of the chunk: whole cache lines, so no two ranks write the same line.
    const size_t elems = m / sizeof(T);
    const size_t part = ((elems + size_ - 1) / size_ + line_elems - 1) / line_elems * line_elems;
    auto part_begin = [&](int p) { return std::min(part * p, elems) * sizeof(T); };
    const size_t lo = part_begin(rank_), hi = part_begin(rank_ + 1);

    // 1. The peers' parts of this rank's input into its slot (its own part it reads in place, in 2).
    auto copy_in = [&](const Piece& piece, size_t at, size_t offset, size_t n) {
      std::memcpy(mine + (offset - done), piece.in + at, n);
    };
    ForEachPiece(pieces, starts, done, done + lo, copy_in);
    ForEachPiece(pieces, starts, done + hi, done + m, copy_in);
    Barrier("copy-in", tensor);

    // 2. This rank's part: the scaled sum over all ranks, into its slot for the peers and into its output.
    for (int p = 0; p < size_; ++p) {
      sources[p] = reinterpret_cast<const T*>(Slot(p, which));
    }
    ForEachPiece(pieces, starts, done + lo, done + hi, [&](const Piece& piece, size_t at, size_t offset, size_t n) {
      const size_t first = (offset - done) / sizeof(T);
      ReduceInRankOrder<Tr>(sources, first, rank_, reinterpret_cast<const T*>(piece.in + at), prescale, postscale,
                            reinterpret_cast<T*>(mine) + first, reinterpret_cast<T*>(piece.out + at), n / sizeof(T));
    });
    Barrier("reduce", tensor);

    // 3. The peers' parts, reduced and scaled by each of them, into this rank's output.
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      const char* from = Slot(p, which);
      ForEachPiece(pieces, starts, done + part_begin(p), done + part_begin(p + 1),
                   [&](const Piece& piece, size_t at, size_t offset, size_t n) {
                     std::memcpy(piece.out + at, from + (offset - done), n);
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
  case HOROVOD_FLOAT16:
    Run<Float16>(pieces, total, prescale, postscale, tensor);
    break;
  case HOROVOD_BFLOAT16:
    Run<BFloat16Type>(pieces, total, prescale, postscale, tensor);
    break;
  case HOROVOD_FLOAT32:
    Run<Plain<float>>(pieces, total, prescale, postscale, tensor);
    break;
  case HOROVOD_FLOAT64:
    Run<Plain<double>>(pieces, total, prescale, postscale, tensor);
    break;
  case HOROVOD_INT32:
    Run<Plain<int32_t>>(pieces, total, prescale, postscale, tensor);
    break;
  case HOROVOD_INT64:
    Run<Plain<int64_t>>(pieces, total, prescale, postscale, tensor);
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
