// Glue of the shared-memory all-reduce and all-gather between the CPU ranks of one node
// (pipefill/comm/shm.py holds the Python side; ARCHITECTURE.md, 'The all-reduce inside a node').
//
// The segment: a header, one control line per rank, then two sets of one data slot per rank:
//
//   [header | line 0 | line 1 | ... | set 0: slot 0, slot 1, ... | set 1: slot 0, slot 1, ...]
//
// A line holds its rank's barrier count (`seq`), pid, state and the description of its current
// call; only its rank writes it, and each line has its own cache lines. A barrier is "store my
// count + 1 (release), then wait until every other count reaches it (acquire)": the stores
// before the barrier (a rank's copy into its slot) are then visible to every rank after it.
//
// A call is cut into pieces of at most one slot. Piece p uses set p % 2: a rank writes set p % 2
// again only at piece p + 2, after the first barrier of piece p + 1, which no rank reaches before
// it has finished reading piece p. So every piece needs one barrier (small pieces: each rank
// sums every slot itself) or two (large pieces: each rank sums its own part of the slots into
// its own slot, a barrier, then each copies every rank's part: reduce-scatter then all-gather,
// so the summing is spread over the ranks). Every element is summed in rank order by one rank
// (or identically by all), so every rank gets the same bits.
//
// Waiting: a bounded spin (pause), then sched_yield for about a millisecond, then sleeps that
// grow to a millisecond, checking whether the awaited rank's process still exists. A dead or
// departed peer, a timeout or ranks that disagree on a call return a sentence (the Python side
// raises it); the group is then unusable and says so on every later call, and this rank marks
// itself failed so that its peers stop waiting for it at once.
#include "glue.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>

#include <chrono>
#include <string>

#include "glue_vector_isa.h"
#include "shm_comm_kernel.h"

namespace {

namespace pg = pipefill_glue;
namespace ps = pipefill_shm;
using pg::Addr;
using Clock = std::chrono::steady_clock;

static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared-memory flags need lock-free atomics");
static_assert(std::atomic<int64_t>::is_always_lock_free, "shared-memory flags need lock-free atomics");

constexpr uint64_t kMagic = 0x31306d68735f6670ull;  // "pf_shm01"
constexpr int64_t kHeaderBytes = 256;
constexpr int64_t kLineBytes = 256;  // two pairs of cache lines: no false sharing, no adjacent-line prefetch
constexpr int64_t kMaxWorld = 256;
constexpr int64_t kPartAlign = 64;  // bytes: the parts of a large piece start on their own cache lines

const char* const kClosed = "this shared-memory group is closed";

enum State : int32_t { kAbsent = 0, kJoined = 1, kLeft = 2, kFailed = 3 };
enum Op : int64_t { kAllReduce = 1, kAllGather = 2 };
struct Header {
  std::atomic<uint64_t> magic;  // written last by the creator
  int64_t world, slot_bytes, total_bytes;
};

struct Call {  // what a rank's call is: every rank's must be the same
  std::atomic<int64_t> op, dtype, count;
};

struct Line {
  std::atomic<uint64_t> seq;
  std::atomic<int64_t> pid;
  std::atomic<uint64_t> pid_ns;  // the inode of its pid namespace: its pid means something here only if equal
  std::atomic<int32_t> state;
  Call call[2];  // by call number parity (a rank may start call c + 1 before a peer read call c)
};
static_assert(sizeof(Header) <= kHeaderBytes && sizeof(Line) <= kLineBytes, "layout");

int64_t data_offset(int64_t world) { return (kHeaderBytes + world * kLineBytes + 4095) / 4096 * 4096; }

int64_t segment_bytes(int64_t world, int64_t slot_bytes) { return data_offset(world) + 2 * world * slot_bytes; }

std::string sys_error(const std::string& what, const std::string& name) {
  return what + " /dev/shm" + name + ": " + std::strerror(errno);
}

// Maps the segment `name` ("/pipefill-..."): created (it must not exist) and initialised when
// `create`, else opened and checked against world and slot_bytes. Returns its address.
uintptr_t map_segment(const std::string& name, int64_t world, int64_t slot_bytes, bool create) {
  if (world < 1 || world > kMaxWorld) throw std::invalid_argument("world must be in [1, 256]");
  if (slot_bytes < 4096 || slot_bytes % 4096) throw std::invalid_argument("slot_bytes must be a positive multiple of 4096");
  const int64_t total = segment_bytes(world, slot_bytes);
  const int fd = shm_open(name.c_str(), create ? O_CREAT | O_EXCL | O_RDWR : O_RDWR, 0600);
  if (fd < 0) throw std::runtime_error(sys_error(create ? "cannot create" : "cannot open", name));
  struct stat st;
  if (create && ftruncate(fd, total) != 0) {
    const std::string e = sys_error("cannot size", name);
    close(fd);
    shm_unlink(name.c_str());
    throw std::runtime_error(e);
  }
  if (!create && (fstat(fd, &st) != 0 || st.st_size != total)) {
    close(fd);
    throw std::runtime_error("/dev/shm" + name + " is not a segment of this group's size (world or max_bytes differ)");
  }
  void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int map_errno = errno;
  close(fd);
  if (p == MAP_FAILED) {
    if (create) shm_unlink(name.c_str());
    errno = map_errno;
    throw std::runtime_error(sys_error("cannot map", name));
  }
  auto* h = static_cast<Header*>(p);
  if (create) {  // ftruncate zero-filled it: every line is absent, every count 0
    h->world = world;
    h->slot_bytes = slot_bytes;
    h->total_bytes = total;
    h->magic.store(kMagic, std::memory_order_release);
  } else if (h->magic.load(std::memory_order_acquire) != kMagic || h->world != world ||
             h->slot_bytes != slot_bytes) {
    munmap(p, total);
    throw std::runtime_error("/dev/shm" + name + " does not hold a group of this world and max_bytes");
  }
  return reinterpret_cast<uintptr_t>(p);
}

void unmap_segment(Addr addr, int64_t bytes) {
  if (addr.value) munmap(addr.as<void>(), bytes);
}

bool unlink_segment(const std::string& name) { return shm_unlink(name.c_str()) == 0; }

uint64_t own_pid_namespace() {
  struct stat st;
  return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

// True when `pid` (of this pid namespace) has exited: no such process, or a zombie.
bool process_gone(int64_t pid) {
  if (pid <= 0) return false;
  if (kill((pid_t)pid, 0) != 0) return errno == ESRCH;
  char path[64], buf[512];
  std::snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return false;
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* close_paren = std::strrchr(buf, ')');  // "pid (comm) S ...": comm may hold anything
  return close_paren && close_paren[1] == ' ' && (close_paren[2] == 'Z' || close_paren[2] == 'X');
}

const char* dtype_name(int64_t dtype) { return dtype == ps::kBF16 ? "bfloat16" : "float32"; }

using SumFn = void (*)(const void* const*, int, void*, int, int64_t);

SumFn sum_for(int isa) {
  if (isa == pg::kAvx512) return ps::avx512::sum_into;
  if (isa == pg::kAvx2) return ps::avx2::sum_into;
  return ps::scalar::sum_into;
}

constexpr int64_t kGrainBytes = 256 << 10;  // per task of torch's pool: small copies stay on this thread

void copy_bytes(void* dst, const void* src, int64_t bytes) {
  if (bytes <= 2 * kGrainBytes) {
    std::memcpy(dst, src, bytes);
    return;
  }
  at::parallel_for(0, bytes, kGrainBytes, [&](int64_t b, int64_t e) {
    std::memcpy(static_cast<char*>(dst) + b, static_cast<const char*>(src) + b, e - b);
  });
}

class Comm {
 public:
  Comm(Addr addr, int rank, int world, int64_t slot_bytes, int isa, int64_t small_max_bytes, double spin_us)
      : base_(addr.as<char>()), rank_(rank), world_(world), slot_bytes_(slot_bytes), sum_(sum_for(isa)),
        small_max_bytes_(small_max_bytes), spin_(std::chrono::nanoseconds((int64_t)(spin_us * 1e3))) {
    if (!base_ || world < 1 || world > kMaxWorld || rank < 0 || rank >= world)
      throw std::invalid_argument("bad rank, world or address");
    if (const char* why = pg::vector_isa_check(isa)) throw std::invalid_argument(std::string("ISA unusable here: ") + why);
    auto* h = reinterpret_cast<Header*>(base_);
    if (h->world != world || h->slot_bytes != slot_bytes) throw std::invalid_argument("segment layout differs");
    Line& me = line(rank_);
    me.pid.store(getpid(), std::memory_order_relaxed);
    me.pid_ns.store(own_pid_namespace(), std::memory_order_relaxed);
    seq_ = me.seq.load(std::memory_order_relaxed);
    me.state.store(kJoined, std::memory_order_release);
  }

  // Sums `n` elements at `data` (float32 or bfloat16) over the ranks, in place. "" or why not.
  std::string all_reduce(Addr data, int64_t n, int dtype, double timeout_s) {
    if (left_) return kClosed;  // a call bound before close() (ShmGroup.bind_all_reduce)
    if (!broken_.empty()) return unusable();
    const int64_t es = dtype == ps::kBF16 ? 2 : 4;
    const int64_t piece = slot_bytes_ / es;
    char* d = data.as<char>();
    timeout_s_ = timeout_s;
    begin_call(kAllReduce, dtype, n);
    int64_t off = 0;
    do {
      const int64_t m = std::min(piece, n - off);
      std::string e = reduce_piece(d + off * es, m, es, dtype, off == 0);
      if (!e.empty()) return fail(e);
      off += m;
    } while (off < n);
    return "";
  }

  // Copies `bytes` at `src` from every rank into `out` (world x bytes, rank order). "" or why not.
  std::string all_gather(Addr src, Addr out, int64_t bytes, double timeout_s) {
    if (left_) return kClosed;
    if (!broken_.empty()) return unusable();
    timeout_s_ = timeout_s;
    begin_call(kAllGather, -1, bytes);
    int64_t off = 0;
    do {
      const int64_t m = std::min(slot_bytes_, bytes - off);
      char* mine = slot(next_set(), rank_);
      copy_bytes(mine, src.as<char>() + off, m);
      std::string e = barrier(off == 0);
      if (!e.empty()) return fail(e);
      for (int k = 0; k < world_; ++k)
        copy_bytes(out.as<char>() + k * bytes + off, slot(set_, k), m);
      off += m;
    } while (off < bytes);
    return "";
  }

  // This rank is done with the group: a peer that still waits for it stops waiting.
  // The segment is unmapped right after: every later call returns kClosed without touching it.
  void leave() {
    if (base_ && !left_) line(rank_).state.store(broken_.empty() ? kLeft : kFailed, std::memory_order_release);
    left_ = true;
  }

  uint64_t seq() const { return seq_; }

 private:
  Line& line(int r) const { return *reinterpret_cast<Line*>(base_ + kHeaderBytes + r * kLineBytes); }
  char* slot(int set, int r) const { return base_ + data_offset(world_) + (set * world_ + r) * slot_bytes_; }
  int next_set() { return set_ = (int)(pieces_++ % 2); }

  void begin_call(int64_t op, int64_t dtype, int64_t count) {
    Call& c = line(rank_).call[calls_ % 2];
    c.op.store(op, std::memory_order_relaxed);
    c.dtype.store(dtype, std::memory_order_relaxed);
    c.count.store(count, std::memory_order_relaxed);  // published by the first barrier's release
  }

  std::string reduce_piece(char* d, int64_t m, int64_t es, int dtype, bool first) {
    char* mine = slot(next_set(), rank_);
    copy_bytes(mine, d, m * es);
    std::string e = barrier(first);
    if (!e.empty()) return e;
    const void* src[kMaxWorld];
    for (int k = 0; k < world_; ++k) src[k] = slot(set_, k);
    if (m * es <= small_max_bytes_) {  // latency first: one barrier, every rank sums everything
      sum_parallel(src, d, dtype, es, 0, m);
      return "";
    }
    const int64_t align = kPartAlign / es;
    const int64_t part = ((m + world_ - 1) / world_ + align - 1) / align * align;
    const int64_t lo = std::min(m, rank_ * part), hi = std::min(m, lo + part);
    sum_parallel(src, mine, dtype, es, lo, hi);
    e = barrier(false);
    if (!e.empty()) return e;
    for (int k = 0; k < world_; ++k) {
      const int64_t b = std::min(m, k * part), en = std::min(m, b + part);
      if (en > b) copy_bytes(d + b * es, slot(set_, k) + b * es, (en - b) * es);
    }
    return "";
  }

  // dst[i] = sum over k of src[k][i] for i in [lo, hi), split over torch's pool when large.
  void sum_parallel(const void* const* src, char* dst, int dtype, int64_t es, int64_t lo, int64_t hi) {
    if (hi <= lo) return;
    const int64_t grain = kGrainBytes / es;
    at::parallel_for(lo, hi, hi - lo <= 2 * grain ? hi - lo : grain, [&](int64_t b, int64_t e) {
      const void* at_b[kMaxWorld];
      for (int k = 0; k < world_; ++k) at_b[k] = static_cast<const char*>(src[k]) + b * es;
      sum_(at_b, world_, dst + b * es, dtype, e - b);
    });
  }

  std::string barrier(bool check_call) {
    ++seq_;
    line(rank_).seq.store(seq_, std::memory_order_release);
    for (int q = 0; q < world_; ++q) {
      if (q == rank_) continue;
      std::string e = wait_for(q);
      if (!e.empty()) return e;
    }
    if (check_call) {
      const int parity = (int)(calls_++ % 2);
      return check_same_call(parity);
    }
    return "";
  }

  std::string wait_for(int q) {
    Line& l = line(q);
    if (l.seq.load(std::memory_order_acquire) >= seq_) return "";
    const auto start = Clock::now();
    const auto deadline = start + std::chrono::nanoseconds((int64_t)(timeout_s_ * 1e9));
    auto next_pid_check = start;
    int64_t sleep_ns = 20000;
    for (int64_t i = 1; l.seq.load(std::memory_order_acquire) < seq_; ++i) {
      if (i % 64) {  // the clock is read once per 64 pauses
        __builtin_ia32_pause();
        continue;
      }
      const auto now = Clock::now();
      if (now - start < spin_) continue;
      if (l.state.load(std::memory_order_acquire) >= kLeft && l.seq.load(std::memory_order_acquire) < seq_)
        return peer_sentence(q, "left the group (it closed it, or gave up after an error of its own)");
      if (now >= next_pid_check) {
        if (peer_exited(l)) return peer_sentence(q, "exited");
        next_pid_check = now + std::chrono::milliseconds(20);
      }
      if (now >= deadline) return timeout_sentence(q);
      if (now - start < spin_ + std::chrono::milliseconds(1)) {
        sched_yield();
      } else {
        const struct timespec ts{0, sleep_ns};
        nanosleep(&ts, nullptr);
        sleep_ns = std::min<int64_t>(sleep_ns * 2, 1000000);
      }
    }
    return "";
  }

  bool peer_exited(const Line& l) const {
    const uint64_t ns = l.pid_ns.load(std::memory_order_relaxed);
    return ns != 0 && ns == own_pid_namespace() && process_gone(l.pid.load(std::memory_order_relaxed));
  }

  std::string peer_sentence(int q, const char* what) const {
    return "rank " + std::to_string(q) + " (pid " + std::to_string(line(q).pid.load()) + ") " + what +
           " while rank " + std::to_string(rank_) + " waited for it at barrier " + std::to_string(seq_);
  }

  std::string timeout_sentence(int q) const {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%g", timeout_s_);
    return "rank " + std::to_string(q) + " (pid " + std::to_string(line(q).pid.load()) + ") did not reach barrier " +
           std::to_string(seq_) + " within " + buf + " s: it is stuck, or died where its pid cannot be seen";
  }

  std::string describe(const Call& c) const {
    const int64_t op = c.op.load(std::memory_order_relaxed);
    if (op == kAllGather) return "all_gather of " + std::to_string(c.count.load(std::memory_order_relaxed)) + " bytes";
    return "all_reduce of " + std::to_string(c.count.load(std::memory_order_relaxed)) + " " +
           dtype_name(c.dtype.load(std::memory_order_relaxed)) + " elements";
  }

  std::string check_same_call(int parity) const {
    const Call& mine = line(rank_).call[parity];
    for (int q = 0; q < world_; ++q) {
      const Call& c = line(q).call[parity];
      if (c.op.load() != mine.op.load() || c.dtype.load() != mine.dtype.load() || c.count.load() != mine.count.load())
        return "ranks disagree on the call: rank " + std::to_string(rank_) + " makes an " + describe(mine) +
               ", rank " + std::to_string(q) + " an " + describe(c);
    }
    return "";
  }

  std::string fail(const std::string& e) {
    broken_ = e;
    line(rank_).state.store(kFailed, std::memory_order_release);
    return e;
  }

  std::string unusable() const { return "the group is unusable after an earlier error: " + broken_; }

  char* base_;
  int rank_, world_;
  int64_t slot_bytes_;
  SumFn sum_;
  int64_t small_max_bytes_;
  Clock::duration spin_;
  double timeout_s_ = 0;  // of the current call: the longest wait for one peer at one barrier
  uint64_t seq_ = 0, pieces_ = 0, calls_ = 0;
  int set_ = 0;
  std::string broken_;
  bool left_ = false;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("isa_supported", &pg::vector_isa_supported);
  m.def("segment_bytes", &segment_bytes);
  m.def("map_segment", &map_segment);
  m.def("unmap_segment", &unmap_segment);
  m.def("unlink_segment", &unlink_segment);
  py::class_<Comm>(m, "Comm")
      .def(py::init<Addr, int, int, int64_t, int, int64_t, double>())
      .def("all_reduce", &Comm::all_reduce, py::call_guard<py::gil_scoped_release>())
      .def("all_gather", &Comm::all_gather, py::call_guard<py::gil_scoped_release>())
      .def("leave", &Comm::leave)
      .def_property_readonly("seq", &Comm::seq);
}
