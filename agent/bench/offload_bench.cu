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
//
// Timing follows nvbandwidth: for pinned memory a spin kernel holds the stream while the copies
// are enqueued, so CUDA events bracket only the copies, not the enqueue cost; the median of the
// samples is the headline. Pageable copies are staged by the driver through the host, so they
// are timed with the same events without the spin kernel (the staging is what a user pays).
// Bidirectional: as nvbandwidth's host_to_device_bidirectional_memcpy_ce and
// device_to_host_bidirectional_memcpy_ce, each stream is timed by its own events and reported
// as its own bytes over its own time (h2d_bidirectional, d2h_bidirectional); no summed figure.

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

constexpr int kSchemaVersion = 2;  // 2: per-stream bidirectional, cpu_affinity, numa_note
constexpr int kExitOk = 0, kExitUsage = 2, kExitNoDevice = 3, kExitCuda = 4, kExitVerify = 5,
              kExitHost = 6;
constexpr size_t kMiB = 1024ull * 1024ull;
// 16 tokens x 131072 B/token (Llama-3-8B fp16 KV), 128- and 512-token pages, a large copy.
const std::vector<size_t> kDefaultSizes = {2 * kMiB, 16 * kMiB, 64 * kMiB, 256 * kMiB};
constexpr int kVerifySamples = 64;
constexpr uint64_t kPoison = 0xA5A5A5A5A5A5A5A5ull;

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
          "usage: offload_bench [--device N] [--sizes B1,B2,...] [--repeat N]\n"
          "                     [--max-seconds S] [--numa-node auto|none|N]\n"
          "                     [--cpus auto|none|LIST] [--version]\n");
      std::exit(kExitOk);
    } else if (a == "--device") {
      o.device = (int)parse_int(value(), "--device");
    } else if (a == "--sizes") {
      o.sizes.clear();
      std::string list = value(), item;
      size_t pos = 0;
      while (pos <= list.size()) {
        size_t comma = list.find(',', pos);
        item = list.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
        long long b = parse_int(item, "--sizes");
        if (b < 8 || b % 8) usage_error("sizes must be positive multiples of 8 bytes: " + item);
        o.sizes.push_back((size_t)b);
        if (comma == std::string::npos) break;
        pos = comma + 1;
      }
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
enum Direction { kH2D, kD2H, kBidir };
const char *direction_name(Direction d) {
  return d == kH2D ? "h2d" : d == kD2H ? "d2h" : "bidirectional";
}
// What a result reports: one direction alone, or one stream while the other direction runs.
const char *stream_name(Direction d, bool other_stream_running) {
  if (!other_stream_running) return direction_name(d);
  return d == kH2D ? "h2d_bidirectional" : "d2h_bidirectional";
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
  Direction dir;             // kH2D or kD2H: the stream this result measured
  bool bidirectional;        // the opposite direction ran at the same time
  bool pinned;
  size_t bytes;
  int copies_per_sample;
  std::vector<double> gbps;
  int numa_node;  // observed node of the host buffers, -1 unknown
  bool truncated;
};

using Clock = std::chrono::steady_clock;

class Bench {
 public:
  Bench(const Options &o, Clock::time_point deadline) : opt_(o), deadline_(deadline) {
    CK(cudaStreamCreateWithFlags(&s0_, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&s1_, cudaStreamNonBlocking));
    CK(cudaEventCreate(&start_));
    CK(cudaEventCreate(&end_));
    CK(cudaEventCreate(&end1_));
    CK(cudaHostAlloc((void **)&release_, sizeof(int), cudaHostAllocMapped));
    CK(cudaHostGetDevicePointer((void **)&release_dev_, release_, 0));
  }
  ~Bench() {
    cudaFreeHost(release_);
    cudaEventDestroy(start_);
    cudaEventDestroy(end_);
    cudaEventDestroy(end1_);
    cudaStreamDestroy(s0_);
    cudaStreamDestroy(s1_);
  }

  bool out_of_time() const { return Clock::now() >= deadline_; }

  // One sample: `copies` copies of `bytes` in direction `dir`; returns the elapsed milliseconds
  // of the host-to-device stream (s0) and of the device-to-host stream (s1 for bidirectional,
  // s0 for d2h alone); 0 for a stream that did not run. Both streams start at the same event
  // and each ends with its own, as nvbandwidth times its measured stream.
  std::pair<float, float> sample(const Buffers &b, Direction dir, size_t bytes, int copies) {
    bool spin = b.pinned;  // pageable copies may block the host: a held stream would deadlock
    if (spin) {
      *release_ = 0;
      spin_kernel<<<1, 1, 0, s0_>>>(release_dev_, 10ull * 1000 * 1000 * 1000);
      CK(cudaGetLastError());
    }
    CK(cudaEventRecord(start_, s0_));
    if (dir == kBidir) CK(cudaStreamWaitEvent(s1_, start_, 0));
    for (int c = 0; c < copies; ++c) {
      if (dir != kD2H)
        CK(cudaMemcpyAsync(b.dev_dst, b.host_src, bytes, cudaMemcpyHostToDevice, s0_));
      if (dir == kD2H)
        CK(cudaMemcpyAsync(b.host_dst, b.dev_src, bytes, cudaMemcpyDeviceToHost, s0_));
      if (dir == kBidir)
        CK(cudaMemcpyAsync(b.host_dst, b.dev_src, bytes, cudaMemcpyDeviceToHost, s1_));
    }
    CK(cudaEventRecord(end_, s0_));
    if (dir == kBidir) CK(cudaEventRecord(end1_, s1_));
    if (spin) *reinterpret_cast<volatile int *>(release_) = 1;
    CK(cudaEventSynchronize(end_));
    float ms0 = 0, ms1 = 0;
    CK(cudaEventElapsedTime(&ms0, start_, end_));
    if (dir == kBidir) {
      CK(cudaEventSynchronize(end1_));
      CK(cudaEventElapsedTime(&ms1, start_, end1_));
    }
    if (dir == kH2D) return {ms0, 0.0f};
    if (dir == kD2H) return {0.0f, ms0};
    return {ms0, ms1};
  }

  // kH2D/kD2H: one result; kBidir: two, one per stream (h2d_bidirectional, d2h_bidirectional).
  std::vector<Result> measure(Buffers &b, Direction dir, size_t bytes, uint64_t seed) {
    size_t words = bytes / sizeof(uint64_t);
    // Fresh source pattern and poisoned destination, so a copy that moved nothing fails below.
    if (dir != kD2H) {
      fill_host(b.host_src, words, seed);
      CK(cudaMemset(b.dev_dst, 0xA5, bytes));
    }
    if (dir != kH2D) {
      fill_kernel<<<256, 256>>>(b.dev_src, words, seed);
      CK(cudaGetLastError());
      std::memset(b.host_dst, 0xA5, bytes);
    }
    CK(cudaDeviceSynchronize());

    // Enough copies per sample that each sample moves >= 256 MiB (event resolution ~0.5 us).
    int copies = (int)std::min<size_t>(128, std::max<size_t>(1, (256 * kMiB + bytes - 1) / bytes));
    bool both = dir == kBidir;
    Result h2d{kH2D, both, b.pinned, bytes, copies, {}, b.observed_node, false};
    Result d2h{kD2H, both, b.pinned, bytes, copies, {}, b.observed_node, false};
    double moved = double(bytes) * copies;  // per stream: each reports its own bytes
    sample(b, dir, bytes, copies);  // warm-up
    for (int i = 0; i < opt_.repeat; ++i) {
      if (out_of_time()) {
        h2d.truncated = d2h.truncated = true;
        break;
      }
      std::pair<float, float> ms = sample(b, dir, bytes, copies);
      if (ms.first > 0) h2d.gbps.push_back(moved / (ms.first * 1e-3) / 1e9);
      if (ms.second > 0) d2h.gbps.push_back(moved / (ms.second * 1e-3) / 1e9);
    }
    std::string why;
    if ((dir != kD2H && !verify(b.dev_dst, true, bytes, seed, &why)) ||
        (dir != kH2D && !verify(b.host_dst, false, bytes, seed, &why)))
      fail(kExitVerify, "copy verification failed",
           std::string(direction_name(dir)) + (b.pinned ? " pinned " : " pageable ") + why);
    if (dir == kH2D) return {h2d};
    if (dir == kD2H) return {d2h};
    return {h2d, d2h};
  }

 private:
  const Options &opt_;
  Clock::time_point deadline_;
  cudaStream_t s0_{}, s1_{};
  cudaEvent_t start_{}, end_{}, end1_{};
  int *release_ = nullptr, *release_dev_ = nullptr;
};

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
  for (size_t s : opt.sizes) {
    if (2 * s > free_b / 10 * 9)
      skipped.push_back({s, "exceeds free GPU memory"});
    else
      sizes.push_back(s);
  }
  size_t max_bytes = sizes.empty() ? 0 : *std::max_element(sizes.begin(), sizes.end());

  std::vector<Result> results;
  bool time_limit_reached = false;
  if (max_bytes) {
    Bench bench(opt, deadline);
    Buffers b;
    CK(cudaMalloc((void **)&b.dev_dst, max_bytes));
    CK(cudaMalloc((void **)&b.dev_src, max_bytes));
    uint64_t seed = 0x5EED;
    // Progress: one JSON line on stderr before each configuration, so a runner can show how far
    // the run is (stdout stays the single report object).
    const int steps = (int)sizes.size() * 5;  // pinned: 3 directions, pageable: 2
    int step = 0;
    for (bool pinned : {true, false}) {
      b.pinned = pinned;
      alloc_host(b, max_bytes, bind_node);
      for (size_t s : sizes) {
        // Pageable copies are staged synchronously by the driver, so one host thread cannot
        // overlap the two directions: a "bidirectional" pageable figure would measure the
        // issuing pattern, not the link. Only pinned memory gets the bidirectional test.
        for (Direction d : {kH2D, kD2H, kBidir}) {
          if (d == kBidir && !pinned) continue;
          std::fprintf(stderr,
                       "{\"progress\": {\"step\": %d, \"steps\": %d, \"direction\": \"%s\", "
                       "\"memory\": \"%s\", \"bytes\": %zu}}\n",
                       ++step, steps, direction_name(d), pinned ? "pinned" : "pageable", s);
          std::fflush(stderr);
          if (bench.out_of_time()) {
            time_limit_reached = true;
            skipped.push_back({s, std::string("time limit: ") + direction_name(d) +
                                      (pinned ? " pinned" : " pageable")});
            continue;
          }
          for (const Result &r : bench.measure(b, d, s, seed++)) {
            if (r.truncated) time_limit_reached = true;
            if (!r.gbps.empty())
              results.push_back(r);
            else
              skipped.push_back({s, std::string("time limit: ") +
                                        stream_name(r.dir, r.bidirectional) +
                                        (pinned ? " pinned" : " pageable")});
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
    std::printf("%s{\"direction\": \"%s\", \"memory\": \"%s\", \"bytes\": %zu, \"repeat\": %zu, "
                "\"copies_per_sample\": %d, \"median_gbps\": %.3f, \"min_gbps\": %.3f, "
                "\"max_gbps\": %.3f, \"host_numa_node\": %s, \"verified\": true}",
                i ? ", " : "", stream_name(r.dir, r.bidirectional), r.pinned ? "pinned" : "pageable", r.bytes,
                r.gbps.size(), r.copies_per_sample, median(r.gbps), *mm.first, *mm.second,
                node_json(r.numa_node).c_str());
  }
  std::printf("], \"skipped\": [");
  for (size_t i = 0; i < skipped.size(); ++i)
    std::printf("%s{\"bytes\": %zu, \"reason\": \"%s\"}", i ? ", " : "", skipped[i].first,
                json_escape(skipped[i].second).c_str());
  std::printf("]}\n");
  return kExitOk;
}
