// hybridmon offload microbenchmark: host<->device copy bandwidth for KV-offload-sized transfers.
//
// Plain C++17 + CUDA runtime; no other libraries. NUMA placement uses raw set_mempolicy /
// get_mempolicy syscalls so libnuma is not a link dependency; CPU placement uses
// sched_setaffinity on the GPU's sysfs local_cpulist (what nvmlDeviceSetCpuAffinity, which
// nvbandwidth calls, computes from the same topology), so libnvidia-ml is not one either.
//
// Output: exactly one JSON object on stdout (schema: docs/offload-bench.md). Exit status:
//   0 measured (possibly cut short by --max-seconds: see "time_limit_reached")
//   2 usage error            3 no CUDA device (cudaGetDeviceCount failed or returned 0)
//   4 CUDA error             5 copy verification failed (a copy did not deliver the data)
//   6 host error (allocation, NUMA placement)
//   7 the driver is older than the CUDA runtime this binary was built with
//
// Timing follows nvbandwidth: for pinned memory a spin kernel holds the stream while the copies
// are enqueued ("queued"), so CUDA events bracket only the copies, not the enqueue cost; the
// median of the samples is the headline. The KV-block sizes (--block-sizes) are also timed
// without the spin kernel ("loop"): the host issues the copies back to back while the GPU runs
// them, as a server's per-layer copy loop does, so the per-copy issue cost shows. Pageable
// copies are staged by the driver through the host, so they are always timed as a loop.
// Bidirectional: as nvbandwidth's host_to_device_bidirectional_memcpy_ce and
// device_to_host_bidirectional_memcpy_ce (testcases_ce.cpp), the measured direction runs on one
// stream while the opposite direction copies twice as many bytes on another, so the measured
// stream is under interference until it ends; each direction is its own test and reported alone
// (its bytes over its own time: h2d_bidirectional, d2h_bidirectional); no summed figure.

#include <cuda_runtime.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <sys/syscall.h>
#include <unistd.h>
#include <sched.h>
#include <vector>

// build.py passes -DHYBRIDMON_BENCH_SOURCE_SHA256=<hex digest> (a bare token, so no shell quoting
// is needed); it is stringified here and printed so a prebuilt binary can be matched to its source.
#define HYBRIDMON_STR2(x) #x
#define HYBRIDMON_STR(x) HYBRIDMON_STR2(x)
#ifdef HYBRIDMON_BENCH_SOURCE_SHA256
#define SOURCE_SHA256 HYBRIDMON_STR(HYBRIDMON_BENCH_SOURCE_SHA256)
#else
#define SOURCE_SHA256 "unknown"
#endif

namespace {

// 2: per-stream bidirectional, cpu_affinity, numa_note. 3: the interfering direction copies
// twice the bytes (nvbandwidth), "issue" per result, KV-block sizes, "interfered_throughout".
constexpr int kSchemaVersion = 3;
constexpr int kExitOk = 0, kExitUsage = 2, kExitNoDevice = 3, kExitCuda = 4, kExitVerify = 5,
              kExitHost = 6, kExitDriverTooOld = 7;
constexpr size_t kKiB = 1024ull, kMiB = 1024ull * 1024ull;
// 16 tokens x 131072 B/token (Llama-3-8B fp16 KV, all layers), 128- and 512-token pages, a
// large copy for the link's peak.
const std::vector<size_t> kDefaultSizes = {2 * kMiB, 16 * kMiB, 64 * kMiB, 256 * kMiB};
// What a server copies per layer: one layer's K (or V) of a block of 16, 64, 128 and 512 tokens
// of Llama-3-8B fp16 (8 KV heads x 128 dims x 2 B = 2048 B per token per layer).
const std::vector<size_t> kDefaultBlockSizes = {32 * kKiB, 128 * kKiB, 256 * kKiB, 1 * kMiB};
// The interfering stream starts with twice the measured stream's bytes (nvbandwidth's "Double
// the size of the interference copy"); where it still ends first (a direction more than twice
// as fast as the other under load), the warm-up doubles the ratio again, up to this factor.
constexpr int kInterferenceFactor = 2, kMaxInterferenceFactor = 8;
// The cap on copies per sample the bench has had since it was written (issue 4). A held stream
// queues every copy of a sample before the clock starts, and how many pending copies a stream
// takes before cudaMemcpyAsync blocks is not documented, so the bidirectional tests never queue
// more than 3 x this (the measured copies and twice as many interfering ones); should enqueueing
// block, the spin kernel frees itself after 10 s and the time limit shows it. The loop timing
// keeps the same count, so a loop and a queued figure differ by the issue cost alone.
constexpr int kMaxCopiesPerSample = 128;
constexpr int kVerifySamples = 64;
constexpr uint64_t kPoison = 0xA5A5A5A5A5A5A5A5ull;

std::string cuda_version_text(int version) {
  return version <= 0 ? "none" : std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
}

std::string json_escape(const std::string &s) {
  std::string out;
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out;
}

[[noreturn]] void fail(int status, const std::string &error, const std::string &detail) {
  std::printf("{\"version\": %d, \"error\": \"%s\", \"detail\": \"%s\"}\n", kSchemaVersion,
              json_escape(error).c_str(), json_escape(detail).c_str());
  std::fflush(stdout);
  std::exit(status);
}

void check(cudaError_t err, const char *call, int line) {
  if (err != cudaSuccess) {
    fail(kExitCuda, "CUDA error",
         std::string(call) + " (line " + std::to_string(line) + "): " + cudaGetErrorName(err) +
             ": " + cudaGetErrorString(err));
  }
}
#define CK(call) check((call), #call, __LINE__)

// ---- NUMA placement (raw syscalls; constants from <linux/mempolicy.h>) ----
constexpr int kMpolDefault = 0, kMpolBind = 2;
constexpr unsigned long kMpolFNode = 1, kMpolFAddr = 2;
constexpr int kMaskLongs = 16;  // 1024 nodes

// Bind this thread's future allocations to `node` (node < 0: back to the default policy).
bool set_thread_node(int node) {
  if (node < 0) return syscall(SYS_set_mempolicy, kMpolDefault, nullptr, 0) == 0;
  if (node >= kMaskLongs * 64) return false;
  unsigned long mask[kMaskLongs] = {};
  mask[node / 64] = 1ul << (node % 64);
  return syscall(SYS_set_mempolicy, kMpolBind, mask, (unsigned long)(kMaskLongs * 64 + 1)) == 0;
}

// NUMA node actually backing the page at `addr`, or -1 when the kernel cannot say.
int node_of(const void *addr) {
  int node = -1;
  if (syscall(SYS_get_mempolicy, &node, nullptr, 0ul, addr, kMpolFNode | kMpolFAddr) != 0)
    return -1;
  return node;
}

// First line of /sys/bus/pci/devices/<bus id>/<attribute>; false when it cannot be read.
bool read_pci_attribute(const std::string &bus_id, const char *attribute, std::string *out) {
  std::string lower = bus_id;
  for (auto &c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  std::FILE *f = std::fopen(("/sys/bus/pci/devices/" + lower + "/" + attribute).c_str(), "r");
  if (!f) return false;
  char buf[4096] = {};
  bool ok = std::fgets(buf, sizeof buf, f) != nullptr;
  std::fclose(f);
  if (!ok) return false;
  *out = buf;
  while (!out->empty() && std::isspace(static_cast<unsigned char>(out->back()))) out->pop_back();
  return true;
}

int gpu_numa_node(const std::string &bus_id) {
  std::string text;
  if (!read_pci_attribute(bus_id, "numa_node", &text)) return -1;
  char *end = nullptr;
  long node = std::strtol(text.c_str(), &end, 10);
  return end == text.c_str() || node < 0 ? -1 : (int)node;
}

// ---- CPU placement ----
// A kernel cpulist ("0-15,32-47") as a set; false when it is malformed or names CPU >= CPU_SETSIZE.
bool parse_cpulist(const std::string &text, cpu_set_t *set) {
  CPU_ZERO(set);
  size_t pos = 0;
  if (text.empty()) return true;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    std::string item = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    char *end = nullptr;
    long first = std::strtol(item.c_str(), &end, 10), last = first;
    if (end == item.c_str()) return false;
    if (*end == '-') {
      const char *from = end + 1;
      last = std::strtol(from, &end, 10);
      if (end == from) return false;
    }
    if (*end || first < 0 || last < first || last >= CPU_SETSIZE) return false;
    for (long cpu = first; cpu <= last; ++cpu) CPU_SET((int)cpu, set);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return true;
}

std::string format_cpulist(const cpu_set_t &set) {
  std::string out;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &set)) continue;
    int last = cpu;
    while (last + 1 < CPU_SETSIZE && CPU_ISSET(last + 1, &set)) ++last;
    if (!out.empty()) out += ",";
    out += std::to_string(cpu) + (last > cpu ? "-" + std::to_string(last) : "");
    cpu = last;
  }
  return out;
}

struct CpuPlacement {
  bool bound = false;
  std::string cpus;  // the calling thread's CPUs after placement (sched_getaffinity)
  std::string note;  // why it is not bound, or empty
};

// Bind the calling thread (and the threads it starts later) to `wanted` intersected with the
// CPUs it may use now (a container's cpuset): sched_setaffinity with CPUs outside the cpuset
// fails or is silently narrowed, so the intersection is made here and said in the report.
CpuPlacement bind_cpus(const cpu_set_t &wanted, const std::string &what) {
  CpuPlacement placement;
  cpu_set_t allowed, chosen;
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) {
    placement.note = std::string("sched_getaffinity failed: ") + std::strerror(errno) + "; not bound";
    return placement;
  }
  CPU_AND(&chosen, &wanted, &allowed);
  if (CPU_COUNT(&chosen) == 0) {
    placement.cpus = format_cpulist(allowed);
    placement.note = what + " " + format_cpulist(wanted) + " share no CPU with the allowed CPUs " +
                     placement.cpus + "; not bound";
    return placement;
  }
  if (sched_setaffinity(0, sizeof chosen, &chosen) != 0) {
    placement.cpus = format_cpulist(allowed);
    placement.note = std::string("sched_setaffinity failed: ") + std::strerror(errno) + "; not bound";
    return placement;
  }
  placement.bound = true;
  placement.cpus = format_cpulist(chosen);
  return placement;
}

std::string current_cpus() {
  cpu_set_t set;
  return sched_getaffinity(0, sizeof set, &set) == 0 ? format_cpulist(set) : "";
}

// ---- data pattern and verification ----
__host__ __device__ inline uint64_t pattern(uint64_t i, uint64_t seed) {
  uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
  x ^= x >> 31;
  return x == kPoison ? x + 1 : x;
}

__global__ void fill_kernel(uint64_t *p, size_t words, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = pattern(i, seed);
}

// Holds its stream until the host sets *release (or a 10 s safety timeout passes).
__global__ void spin_kernel(volatile int *release, unsigned long long timeout_ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (*release == 0 && now - start < timeout_ns);
}

void fill_host(uint64_t *p, size_t words, uint64_t seed) {
  for (size_t i = 0; i < words; ++i) p[i] = pattern(i, seed);
}

std::vector<size_t> sample_indices(size_t words) {
  std::vector<size_t> idx = {0, words - 1};
  uint64_t x = 0x243F6A8885A308D3ull;
  while ((int)idx.size() < kVerifySamples) {
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    idx.push_back(x % words);
  }
  return idx;
}

// True when every sampled word of the destination holds the source pattern.
bool verify(const void *dst, bool dst_on_device, size_t bytes, uint64_t seed, std::string *why) {
  size_t words = bytes / sizeof(uint64_t);
  for (size_t i : sample_indices(words)) {
    uint64_t got;
    const uint64_t *p = static_cast<const uint64_t *>(dst) + i;
    if (dst_on_device)
      CK(cudaMemcpy(&got, p, sizeof got, cudaMemcpyDeviceToHost));
    else
      got = *p;
    if (got != pattern(i, seed)) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "word %zu of %zu bytes: got 0x%016llx, expected 0x%016llx", i,
                    bytes, (unsigned long long)got, (unsigned long long)pattern(i, seed));
      *why = buf;
      return false;
    }
  }
  return true;
}

// ---- options ----
struct Options {
  int device = 0;
  std::vector<size_t> sizes = kDefaultSizes;
  std::vector<size_t> block_sizes = kDefaultBlockSizes;
  int repeat = 10;
  double max_seconds = 60.0;
  enum { kAuto, kNone, kNode } numa_mode = kAuto;
  int numa_node = -1;
  enum { kCpuAuto, kCpuNone, kCpuList } cpu_mode = kCpuAuto;
  std::string cpu_list;
};

void usage_error(const std::string &msg) { fail(kExitUsage, "usage", msg); }

long long parse_int(const std::string &s, const char *what) {
  char *end = nullptr;
  errno = 0;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno || end == s.c_str() || *end) usage_error(std::string("bad ") + what + ": " + s);
  return v;
}

// "B1,B2,..." bytes, each a positive multiple of 8 (the verification reads 8-byte words);
// "none" is the empty list.
std::vector<size_t> parse_sizes(const std::string &list, const char *what) {
  std::vector<size_t> sizes;
  if (list == "none") return sizes;
  size_t pos = 0;
  while (pos <= list.size()) {
    size_t comma = list.find(',', pos);
    std::string item = list.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    long long b = parse_int(item, what);
    if (b < 8 || b % 8) usage_error(std::string(what) + ": sizes must be positive multiples of 8 bytes: " + item);
    sizes.push_back((size_t)b);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return sizes;
}

Options parse_args(int argc, char **argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error("missing value for " + a);
      return argv[++i];
    };
    if (a == "--version") {
      std::printf("{\"version\": %d, \"source_sha256\": \"%s\"}\n", kSchemaVersion,
                  SOURCE_SHA256);
      std::exit(kExitOk);
    } else if (a == "--help" || a == "-h") {
      std::printf(
          "usage: offload_bench [--device N] [--sizes B1,B2,...] [--block-sizes B1,...|none]\n"
          "                     [--repeat N] [--max-seconds S] [--numa-node auto|none|N]\n"
          "                     [--cpus auto|none|LIST] [--version]\n");
      std::exit(kExitOk);
    } else if (a == "--device") {
      o.device = (int)parse_int(value(), "--device");
    } else if (a == "--sizes") {
      o.sizes = parse_sizes(value(), "--sizes");
    } else if (a == "--block-sizes") {
      o.block_sizes = parse_sizes(value(), "--block-sizes");
    } else if (a == "--repeat") {
      long long r = parse_int(value(), "--repeat");
      if (r < 1 || r > 100000) usage_error("--repeat must be in 1..100000");
      o.repeat = (int)r;
    } else if (a == "--max-seconds") {
      std::string v = value();
      char *end = nullptr;
      o.max_seconds = std::strtod(v.c_str(), &end);
      if (end == v.c_str() || *end || !(o.max_seconds > 0)) usage_error("bad --max-seconds: " + v);
    } else if (a == "--numa-node") {
      std::string v = value();
      if (v == "auto") {
        o.numa_mode = Options::kAuto;
      } else if (v == "none") {
        o.numa_mode = Options::kNone;
      } else {
        o.numa_mode = Options::kNode;
        o.numa_node = (int)parse_int(v, "--numa-node");
        if (o.numa_node < 0 || o.numa_node >= kMaskLongs * 64) usage_error("bad --numa-node: " + v);
      }
    } else if (a == "--cpus") {
      std::string v = value();
      if (v == "auto") {
        o.cpu_mode = Options::kCpuAuto;
      } else if (v == "none") {
        o.cpu_mode = Options::kCpuNone;
      } else {
        cpu_set_t check;
        if (v.empty() || !parse_cpulist(v, &check)) usage_error("bad --cpus: " + v);
        o.cpu_mode = Options::kCpuList;
        o.cpu_list = v;
      }
    } else {
      usage_error("unknown option: " + a);
    }
  }
  return o;
}

// ---- measurement ----
enum Direction { kH2D, kD2H };
// How the copies reach the GPU: all enqueued behind a spin kernel first (nvbandwidth's timing:
// only the copies are timed), or issued by the host while the GPU runs them (a server's loop:
// the per-copy issue cost is timed too).
enum Issue { kQueued, kLoop };

struct Test {
  Direction dir;
  bool interfered;  // the opposite direction copies at the same time (the bidirectional tests)
  Issue issue;
};

const char *direction_name(Direction d) { return d == kH2D ? "h2d" : "d2h"; }
const char *issue_name(Issue i) { return i == kQueued ? "queued" : "loop"; }
// What a result reports: one direction alone, or one direction while the other copies too.
const char *test_name(const Test &t) {
  if (!t.interfered) return direction_name(t.dir);
  return t.dir == kH2D ? "h2d_bidirectional" : "d2h_bidirectional";
}

struct Buffers {
  bool pinned = false;
  uint64_t *host_src = nullptr, *host_dst = nullptr;  // h2d source, d2h destination
  uint64_t *dev_dst = nullptr, *dev_src = nullptr;    // h2d destination, d2h source
  int observed_node = -1;
};

void alloc_host(Buffers &b, size_t bytes, int bind_node) {
  if (bind_node >= 0 && !set_thread_node(bind_node))
    fail(kExitHost, "NUMA placement failed",
         "set_mempolicy(MPOL_BIND, node " + std::to_string(bind_node) + "): " +
             std::strerror(errno));
  for (uint64_t **p : {&b.host_src, &b.host_dst}) {
    if (b.pinned) {
      CK(cudaHostAlloc((void **)p, bytes, cudaHostAllocDefault));
    } else {
      *p = static_cast<uint64_t *>(std::malloc(bytes));
      if (!*p) fail(kExitHost, "host allocation failed", std::to_string(bytes) + " bytes");
    }
    std::memset(*p, 0, bytes);  // first touch under the bound policy
  }
  if (bind_node >= 0) set_thread_node(-1);
  b.observed_node = node_of(b.host_src);
}

void free_host(Buffers &b) {
  for (uint64_t *p : {b.host_src, b.host_dst}) {
    if (b.pinned)
      CK(cudaFreeHost(p));
    else
      std::free(p);
  }
  b.host_src = b.host_dst = nullptr;
}

struct Result {
  Test test;
  bool pinned;
  size_t bytes;
  int copies_per_sample;
  int interfering_copies_per_sample;  // 0 without interference
  bool interfered_throughout;         // every sample's interfering stream ended after the measured one
  std::vector<double> gbps;
  int numa_node;  // observed node of the host buffers, -1 unknown
  bool truncated;
};

using Clock = std::chrono::steady_clock;

class Bench {
 public:
  Bench(const Options &o, Clock::time_point deadline) : opt_(o), deadline_(deadline) {
    CK(cudaStreamCreateWithFlags(&measured_, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&interfering_, cudaStreamNonBlocking));
    CK(cudaEventCreate(&start_));
    CK(cudaEventCreate(&end_));
    CK(cudaEventCreate(&interfering_end_));
    CK(cudaHostAlloc((void **)&release_, sizeof(int), cudaHostAllocMapped));
    CK(cudaHostGetDevicePointer((void **)&release_dev_, release_, 0));
  }
  ~Bench() {
    cudaFreeHost(release_);
    cudaEventDestroy(start_);
    cudaEventDestroy(end_);
    cudaEventDestroy(interfering_end_);
    cudaStreamDestroy(measured_);
    cudaStreamDestroy(interfering_);
  }

  bool out_of_time() const { return Clock::now() >= deadline_; }

  // One sample: `copies` copies of `bytes` in the test's direction on the measured stream and,
  // for an interfered test, `interfering_copies` of the same size the opposite way on the other
  // stream, which starts at the measured stream's start event (nvbandwidth's cuStreamWaitEvent).
  // Returns the elapsed milliseconds of the measured stream and of the interfering one (0 when
  // none), each from the shared start to its own end event.
  std::pair<float, float> sample(const Buffers &b, const Test &t, size_t bytes, int copies,
                                 int interfering_copies) {
    // Pageable copies may block the host while the driver stages them: a held stream would
    // deadlock, so they are always issued as a loop.
    bool spin = t.issue == kQueued && b.pinned;
    if (spin) {
      *release_ = 0;
      spin_kernel<<<1, 1, 0, measured_>>>(release_dev_, 10ull * 1000 * 1000 * 1000);
      CK(cudaGetLastError());
    }
    CK(cudaEventRecord(start_, measured_));
    for (int c = 0; c < copies; ++c) copy(b, t.dir, bytes, measured_);
    CK(cudaEventRecord(end_, measured_));
    if (t.interfered) {
      CK(cudaStreamWaitEvent(interfering_, start_, 0));
      Direction other = t.dir == kH2D ? kD2H : kH2D;
      for (int c = 0; c < interfering_copies; ++c) copy(b, other, bytes, interfering_);
      CK(cudaEventRecord(interfering_end_, interfering_));
    }
    if (spin) *reinterpret_cast<volatile int *>(release_) = 1;
    CK(cudaEventSynchronize(end_));
    float measured_ms = 0, interfering_ms = 0;
    CK(cudaEventElapsedTime(&measured_ms, start_, end_));
    if (t.interfered) {
      CK(cudaEventSynchronize(interfering_end_));
      CK(cudaEventElapsedTime(&interfering_ms, start_, interfering_end_));
    }
    return {measured_ms, interfering_ms};
  }

  Result measure(Buffers &b, const Test &t, size_t bytes, uint64_t seed) {
    size_t words = bytes / sizeof(uint64_t);
    bool h2d_runs = t.dir == kH2D || t.interfered, d2h_runs = t.dir == kD2H || t.interfered;
    // Fresh source pattern and poisoned destination, so a copy that moved nothing fails below.
    if (h2d_runs) {
      fill_host(b.host_src, words, seed);
      CK(cudaMemset(b.dev_dst, 0xA5, bytes));
    }
    if (d2h_runs) {
      fill_kernel<<<256, 256>>>(b.dev_src, words, seed);
      CK(cudaGetLastError());
      std::memset(b.host_dst, 0xA5, bytes);
    }
    CK(cudaDeviceSynchronize());

    // Enough copies per sample that each sample moves >= 256 MiB (event resolution ~0.5 us),
    // at most kMaxCopiesPerSample (a 32 KiB sample then moves 4 MiB: ~0.2 ms on Gen4 x16).
    int copies = (int)std::min<size_t>(kMaxCopiesPerSample,
                                       std::max<size_t>(1, (256 * kMiB + bytes - 1) / bytes));
    int interfering = t.interfered ? kInterferenceFactor * copies : 0;
    // Warm-up; for an interfered test also the check that the interfering stream outlasts the
    // measured one (the measured direction must never run its tail alone, issue 29). The ratio
    // is raised by halving the measured copies where there are several to halve, so no more are
    // queued than at the start, else by doubling the interfering ones (then only a few).
    std::pair<float, float> warm = sample(b, t, bytes, copies, interfering);
    while (t.interfered && warm.second < warm.first &&
           interfering < kMaxInterferenceFactor * copies) {
      if (copies > 1 && copies % 2 == 0)
        copies /= 2;
      else
        interfering *= 2;
      warm = sample(b, t, bytes, copies, interfering);
    }
    Result r{t, b.pinned, bytes, copies, interfering, t.interfered, {}, b.observed_node, false};
    double moved = double(bytes) * copies;  // the measured stream's own bytes
    for (int i = 0; i < opt_.repeat; ++i) {
      if (out_of_time()) {
        r.truncated = true;
        break;
      }
      std::pair<float, float> ms = sample(b, t, bytes, copies, interfering);
      if (ms.first <= 0) continue;
      r.gbps.push_back(moved / (ms.first * 1e-3) / 1e9);
      if (t.interfered && ms.second < ms.first) r.interfered_throughout = false;
    }
    std::string why;
    if ((h2d_runs && !verify(b.dev_dst, true, bytes, seed, &why)) ||
        (d2h_runs && !verify(b.host_dst, false, bytes, seed, &why)))
      fail(kExitVerify, "copy verification failed",
           std::string(test_name(t)) + (b.pinned ? " pinned " : " pageable ") + why);
    return r;
  }

 private:
  static void copy(const Buffers &b, Direction d, size_t bytes, cudaStream_t stream) {
    if (d == kH2D)
      CK(cudaMemcpyAsync(b.dev_dst, b.host_src, bytes, cudaMemcpyHostToDevice, stream));
    else
      CK(cudaMemcpyAsync(b.host_dst, b.dev_src, bytes, cudaMemcpyDeviceToHost, stream));
  }

  const Options &opt_;
  Clock::time_point deadline_;
  cudaStream_t measured_{}, interfering_{};
  cudaEvent_t start_{}, end_{}, interfering_end_{};
  int *release_ = nullptr, *release_dev_ = nullptr;
};

// What is measured at each size: the transfer sizes get each direction alone and each under the
// opposite direction's interference (pinned, queued) and each direction alone as a loop
// (pageable); the KV-block sizes get each direction alone, pinned, both queued and as a loop.
std::vector<Test> tests_for(bool pinned, bool block_size) {
  const Test h2d{kH2D, false, kQueued}, d2h{kD2H, false, kQueued};
  const Test h2d_loop{kH2D, false, kLoop}, d2h_loop{kD2H, false, kLoop};
  if (!pinned) return block_size ? std::vector<Test>{} : std::vector<Test>{h2d_loop, d2h_loop};
  if (block_size) return {h2d, d2h, h2d_loop, d2h_loop};
  return {h2d, d2h, {kH2D, true, kQueued}, {kD2H, true, kQueued}};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

std::string node_json(int node) { return node < 0 ? "null" : std::to_string(node); }

}  // namespace

int main(int argc, char **argv) {
  Options opt = parse_args(argc, argv);
  auto t0 = Clock::now();
  // An explicit CPU list is applied before the first CUDA call, so every thread the runtime
  // starts inherits it; `auto` needs the GPU's bus id, so it follows cudaSetDevice (as
  // nvbandwidth's nvmlDeviceSetCpuAffinity follows cuInit) and binds the thread issuing copies.
  CpuPlacement cpu;
  if (opt.cpu_mode == Options::kCpuList) {
    cpu_set_t wanted;
    parse_cpulist(opt.cpu_list, &wanted);
    cpu = bind_cpus(wanted, "--cpus");
  }
  auto deadline = t0 + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(opt.max_seconds));

  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaErrorInsufficientDriver) {
    // The runtime says this both when no driver is loaded (cudaDriverGetVersion gives 0) and
    // when the driver supports an older CUDA than the runtime linked into this binary; only the
    // second is a driver to update (or a binary to build with an older toolkit).
    int driver_version = 0, runtime_version = 0;
    cudaDriverGetVersion(&driver_version);
    cudaRuntimeGetVersion(&runtime_version);
    if (driver_version > 0)
      fail(kExitDriverTooOld, "CUDA driver too old",
           "the CUDA runtime " + cuda_version_text(runtime_version) +
               " this binary was built with needs a newer driver than the installed one, which "
               "supports CUDA up to " + cuda_version_text(driver_version) +
               ": update the NVIDIA driver, or build the benchmark with a CUDA toolkit no newer "
               "than " + cuda_version_text(driver_version) + " (cudaErrorInsufficientDriver)");
  }
  if (err != cudaSuccess || count == 0)
    fail(kExitNoDevice, "no CUDA device",
         err != cudaSuccess ? std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err)
                            : "cudaGetDeviceCount returned 0");
  if (opt.device < 0 || opt.device >= count)
    usage_error("--device " + std::to_string(opt.device) + " out of range (" +
                std::to_string(count) + " devices)");
  CK(cudaSetDevice(opt.device));

  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, opt.device));
  char bus_id[32] = {};
  CK(cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, opt.device));
  int driver = 0, runtime = 0;
  CK(cudaDriverGetVersion(&driver));
  CK(cudaRuntimeGetVersion(&runtime));
  int gpu_node = gpu_numa_node(bus_id);
  if (opt.cpu_mode == Options::kCpuAuto) {
    std::string local;
    cpu_set_t wanted;
    if (!read_pci_attribute(bus_id, "local_cpulist", &local) || local.empty() ||
        !parse_cpulist(local, &wanted) || CPU_COUNT(&wanted) == 0)
      cpu.note = "no locality known (no readable local_cpulist for " + std::string(bus_id) +
                 "), not bound";
    else
      cpu = bind_cpus(wanted, "the GPU's local CPUs");
  } else if (opt.cpu_mode == Options::kCpuNone) {
    cpu.note = "not bound (--cpus none)";
  }
  if (cpu.cpus.empty()) cpu.cpus = current_cpus();
  int bind_node = opt.numa_mode == Options::kNode   ? opt.numa_node
                  : opt.numa_mode == Options::kAuto ? gpu_node
                                                    : -1;
  std::string numa_note;
  if (opt.numa_mode == Options::kAuto && gpu_node < 0) {
    numa_note = "no locality known (sysfs numa_node is -1 or unreadable), memory not bound";
  } else if (opt.numa_mode == Options::kNone) {
    numa_note = "not bound (--numa-node none)";
  } else if (bind_node >= 0 && !set_thread_node(bind_node)) {
    // E.g. EINVAL: the node is outside this cgroup's cpuset.mems. Asked for explicitly, that
    // is an error; chosen automatically, the local run goes on unbound and says so.
    std::string why = "set_mempolicy(MPOL_BIND, node " + std::to_string(bind_node) +
                      "): " + std::strerror(errno);
    if (opt.numa_mode == Options::kNode) fail(kExitHost, "NUMA placement failed", why);
    numa_note = why + " (is the node outside this process's cpuset.mems?), memory not bound";
    bind_node = -1;
  }
  set_thread_node(-1);

  // Two device buffers of the largest size (bidirectional needs both); keep 10 % of free memory.
  size_t free_b = 0, total_b = 0;
  CK(cudaMemGetInfo(&free_b, &total_b));
  std::vector<size_t> sizes;
  std::vector<std::pair<size_t, std::string>> skipped;
  std::vector<size_t> block_sizes;
  for (auto [wanted, kept] : {std::make_pair(&opt.sizes, &sizes), std::make_pair(&opt.block_sizes, &block_sizes)})
    for (size_t s : *wanted) {
      if (2 * s > free_b / 10 * 9)
        skipped.push_back({s, "exceeds free GPU memory"});
      else
        kept->push_back(s);
    }
  size_t max_bytes = 0;
  for (size_t s : sizes) max_bytes = std::max(max_bytes, s);
  for (size_t s : block_sizes) max_bytes = std::max(max_bytes, s);

  std::vector<Result> results;
  bool time_limit_reached = false;
  if (max_bytes) {
    Bench bench(opt, deadline);
    Buffers b;
    CK(cudaMalloc((void **)&b.dev_dst, max_bytes));
    CK(cudaMalloc((void **)&b.dev_src, max_bytes));
    uint64_t seed = 0x5EED;
    // Progress: one JSON line on stderr before each test, so a runner can show how far the run
    // is (stdout stays the single report object).
    int steps = 0;
    for (bool pinned : {true, false})
      steps += (int)(sizes.size() * tests_for(pinned, false).size() +
                     block_sizes.size() * tests_for(pinned, true).size());
    int step = 0;
    for (bool pinned : {true, false}) {
      b.pinned = pinned;
      alloc_host(b, max_bytes, bind_node);
      for (bool block_size : {false, true}) {
        for (size_t s : block_size ? block_sizes : sizes) {
          // Pageable copies are staged synchronously by the driver, so one host thread cannot
          // overlap the two directions: a "bidirectional" pageable figure would measure the
          // issuing pattern, not the link. Only pinned memory gets the bidirectional tests.
          for (const Test &t : tests_for(pinned, block_size)) {
            std::string what = std::string(test_name(t)) + (pinned ? " pinned " : " pageable ") +
                               issue_name(t.issue);
            std::fprintf(stderr,
                         "{\"progress\": {\"step\": %d, \"steps\": %d, \"direction\": \"%s\", "
                         "\"memory\": \"%s\", \"issue\": \"%s\", \"bytes\": %zu}}\n",
                         ++step, steps, test_name(t), pinned ? "pinned" : "pageable",
                         issue_name(t.issue), s);
            std::fflush(stderr);
            if (bench.out_of_time()) {
              time_limit_reached = true;
              skipped.push_back({s, "time limit: " + what});
              continue;
            }
            Result r = bench.measure(b, t, s, seed++);
            if (r.truncated) time_limit_reached = true;
            if (!r.gbps.empty())
              results.push_back(r);
            else
              skipped.push_back({s, "time limit: " + what});
          }
        }
      }
      free_host(b);
    }
    CK(cudaFree(b.dev_dst));
    CK(cudaFree(b.dev_src));
  }

  double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
  std::printf("{\"version\": %d, \"source_sha256\": \"%s\", ", kSchemaVersion,
              SOURCE_SHA256);
  std::printf("\"device\": {\"index\": %d, \"name\": \"%s\", \"pci_bus_id\": \"%s\", "
              "\"numa_node\": %s, \"total_memory_bytes\": %zu, \"free_memory_bytes\": %zu}, ",
              opt.device, json_escape(prop.name).c_str(), json_escape(bus_id).c_str(),
              node_json(gpu_node).c_str(), total_b, free_b);
  std::printf("\"cuda_driver_version\": %d, \"cuda_runtime_version\": %d, ", driver, runtime);
  std::printf("\"numa_node\": %s, \"numa_policy\": \"%s\", \"numa_note\": %s, ",
              node_json(bind_node).c_str(), bind_node >= 0 ? "bind" : "default",
              numa_note.empty() ? "null" : ("\"" + json_escape(numa_note) + "\"").c_str());
  std::printf("\"cpu_affinity\": {\"bound\": %s, \"cpus\": \"%s\", \"note\": %s}, ",
              cpu.bound ? "true" : "false", json_escape(cpu.cpus).c_str(),
              cpu.note.empty() ? "null" : ("\"" + json_escape(cpu.note) + "\"").c_str());
  std::printf("\"repeat_requested\": %d, \"max_seconds\": %g, \"elapsed_seconds\": %.3f, "
              "\"time_limit_reached\": %s, ",
              opt.repeat, opt.max_seconds, elapsed, time_limit_reached ? "true" : "false");
  std::printf("\"results\": [");
  for (size_t i = 0; i < results.size(); ++i) {
    const Result &r = results[i];
    auto mm = std::minmax_element(r.gbps.begin(), r.gbps.end());
    std::string interference = "";
    if (r.test.interfered)
      interference = ", \"interfering_copies_per_sample\": " +
                     std::to_string(r.interfering_copies_per_sample) +
                     ", \"interfered_throughout\": " + (r.interfered_throughout ? "true" : "false");
    std::printf("%s{\"direction\": \"%s\", \"memory\": \"%s\", \"issue\": \"%s\", \"bytes\": %zu, "
                "\"repeat\": %zu, \"copies_per_sample\": %d%s, \"median_gbps\": %.3f, "
                "\"min_gbps\": %.3f, \"max_gbps\": %.3f, \"host_numa_node\": %s, \"verified\": true}",
                i ? ", " : "", test_name(r.test), r.pinned ? "pinned" : "pageable",
                issue_name(r.test.issue), r.bytes, r.gbps.size(),
                r.copies_per_sample, interference.c_str(), median(r.gbps), *mm.first, *mm.second,
                node_json(r.numa_node).c_str());
  }
  std::printf("], \"skipped\": [");
  for (size_t i = 0; i < skipped.size(); ++i)
    std::printf("%s{\"bytes\": %zu, \"reason\": \"%s\"}", i ? ", " : "", skipped[i].first,
                json_escape(skipped[i].second).c_str());
  std::printf("]}\n");
  return kExitOk;
}
