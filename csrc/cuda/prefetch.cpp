// The prefetch engine: copies experts from host RAM into slots of the fast-tier pool on the GPU.
//
// One engine = one thread + one CUDA stream (non-blocking: it never syncs with the compute stream
// by accident). Python queues copies (one item = one expert = up to MAX_SEGMENTS segments: gate_up
// and down, and their scales and zero points when quantized) at a priority level; the thread issues
// them highest level first, FIFO within a level, and keeps at most `max_inflight` issued but not complete. A CUDA stream is FIFO, so without that
// bound everything queued would be issued at once and a late high-level expert would wait behind
// every low-level one.
//
// Orderings (the same two engine/experts/cache.py documents for the PyTorch path):
// - copies after reads: before each copy the stream waits on `compute_done`, an event Python
//   re-records on the compute stream after each layer's fast-tier work (mark_compute), so a freed
//   slot is overwritten only after the kernels that may still read it;
// - reads after copies: each slot has one readiness event, recorded after its latest copy;
//   query(slot) says READY only once it completed, and Python computes a slot only then.
//
// Pageable sources (the mmap tier) are first copied by this thread into pinned staging buffers
// (a ring of max_inflight, reused once their copy completed), so every device copy is a true DMA.
//
// Cancellation drops queued items only (an issued copy cannot be recalled). At most one item per
// slot is queued: queuing a slot again replaces its queued item (the slot was freed and reused).
//
// Built with -DMOECHAT_HOST_BACKEND this is the same engine without CUDA: memcpy for the copies,
// counters for the events, and a host "stream" (a FIFO the engine thread runs) that `hold` can
// stall the way a busy compute stream stalls copies waiting on compute_done. That build is what
// the CPU-only tests exercise.
//
// C ABI for ctypes: opaque handle, int return codes (0 ok, -1 bad argument, -2 engine failure),
// moechat_pf_last_error() for the message of the calling thread's last failed call.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#ifndef MOECHAT_HOST_BACKEND
#include "cuda_api.h"  // the runtime functions it calls: libcudart alone, no toolkit headers
#endif

#define API extern "C" __attribute__((visibility("default")))

namespace {

enum State { IDLE = 0, QUEUED = 1, IN_FLIGHT = 2, READY = 3 };
constexpr int BAD_ARGUMENT = -1, FAILED = -2;
constexpr int MAX_SEGMENTS = 6;  // gate_up and down, each with scales and zero points when quantized
constexpr size_t LOG_CAP = 1 << 16;
using Clock = std::chrono::steady_clock;

thread_local std::string t_error;  // the calling thread's last failed call

struct Segment {
  const uint8_t* src;
  uint8_t* dst;
  size_t bytes;
};

struct Item {
  uint64_t seq;
  int slot, layer, level, nseg;
  bool pinned;
  Segment seg[MAX_SEGMENTS];
  size_t bytes() const {
    size_t total = 0;
    for (int i = 0; i < nseg; ++i) total += seg[i].bytes;
    return total;
  }
};

struct Flight {  // an issued item, until its copy completed
  Item item;
  int staging;  // staging buffer it holds, -1 none
  bool issued;  // its readiness event is recorded
};

struct Staging {
  uint8_t* ptr = nullptr;
  size_t bytes = 0;
  bool busy = false;
};

struct Slot {
  uint64_t queued = 0;  // seq of its queued item, 0 none
  int level = 0;        // level of that item
  int issuing = 0;      // popped, its event not recorded yet
  bool issued = false;  // a copy was ever issued: the event means something
#ifdef MOECHAT_HOST_BACKEND
  uint64_t recorded = 0, executed = 0;  // the "event": complete when every recorded copy ran
#else
  cudaEvent_t ready = nullptr;
#endif
};

#ifdef MOECHAT_HOST_BACKEND
struct HostOp {  // one item's copies on the host "stream"
  int slot, nseg;
  Segment seg[MAX_SEGMENTS];
};
#else
std::string cuda_error(const char* what, cudaError_t err) {  // NULL for every code: CUDA 13 on Windows without a driver
  const char* said = cudaGetErrorString(err);
  return std::string(what) + " failed: " + (said ? said : "CUDA error " + std::to_string(err));
}
#define CUDA_TRY(call)                                      \
  do {                                                      \
    cudaError_t err_ = (call);                              \
    if (err_ != cudaSuccess) return cuda_error(#call, err_); \
  } while (0)
#endif

}  // namespace

struct Counters {
  uint64_t bytes;         // copied into slots (completed copies)
  uint64_t copies;        // completed expert copies
  uint64_t staged_bytes;  // of those, bytes that went through pinned staging
  uint64_t cancelled;     // queued items dropped (cancel, cancel_below, replaced, destroy)
  uint64_t queued;        // items waiting now
  uint64_t in_flight;     // items issued, not complete, now
  double busy_s;          // wall time with at least one copy in flight
};

struct Engine {
  int device, nslots, nlevels, max_inflight;
  std::mutex mu;
  std::condition_variable work;  // the engine thread: something to do
  std::condition_variable idle;  // wait_idle: nothing queued, nothing in flight
  std::thread thread;
  std::vector<std::deque<Item>> queues;  // [level], FIFO each
  size_t queued = 0;
  std::vector<Slot> slots;
  std::deque<Flight> flights;  // issue order = completion order (one stream)
  std::vector<Staging> staging;
  std::vector<int32_t> log;  // slots in issue order (tests, diagnostics), at most LOG_CAP
  bool stop = false, paused = false;
  uint64_t next_seq = 1;
  Counters stats{};
  Clock::time_point busy_since;
  std::string error;  // sticky: the engine thread failed
  bool started = false;  // init() ran (error says whether it failed)
#ifdef MOECHAT_HOST_BACKEND
  std::deque<HostOp> stream;
  bool hold = false;  // the host stream is stalled (a busy compute stream, for tests)
#else
  cudaStream_t stream = nullptr;
  cudaEvent_t compute_done = nullptr;
#endif

  Engine(int device_, int nslots_, int nlevels_, int max_inflight_)
      : device(device_), nslots(nslots_), nlevels(nlevels_), max_inflight(max_inflight_),
        queues(nlevels_), slots(nslots_), staging(max_inflight_) {}

  // --- device backend ----------------------------------------------------------------------
  std::string init() {
#ifndef MOECHAT_HOST_BACKEND
    CUDA_TRY(cudaSetDevice(device));
    CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    CUDA_TRY(cudaEventCreateWithFlags(&compute_done, cudaEventDisableTiming));
    for (Slot& s : slots)  // blocking sync: the thread sleeps while it waits on a copy
      CUDA_TRY(cudaEventCreateWithFlags(&s.ready, cudaEventDisableTiming | cudaEventBlockingSync));
#endif
    return "";
  }

  void release() {  // engine thread, after drain(): nothing of ours is in use
    for (Staging& b : staging) free_host(b.ptr);
#ifndef MOECHAT_HOST_BACKEND
    for (Slot& s : slots)
      if (s.ready) cudaEventDestroy(s.ready);
    if (compute_done) cudaEventDestroy(compute_done);
    if (stream) cudaStreamDestroy(stream);
#endif
  }

  static void free_host(uint8_t* p) {
#ifdef MOECHAT_HOST_BACKEND
    std::free(p);
#else
    if (p) cudaFreeHost(p);
#endif
  }

  std::string grow(Staging& b, size_t bytes) {  // engine thread, buffer not busy
    if (b.bytes >= bytes) return "";
    free_host(b.ptr);
    b.ptr = nullptr;
    b.bytes = 0;
#ifdef MOECHAT_HOST_BACKEND
    b.ptr = static_cast<uint8_t*>(std::malloc(bytes));
    if (!b.ptr) return "out of host memory for staging";
#else
    void* p = nullptr;
    CUDA_TRY(cudaHostAlloc(&p, bytes, cudaHostAllocDefault));
    b.ptr = static_cast<uint8_t*>(p);
#endif
    b.bytes = bytes;
    return "";
  }

  // Queue one item's copies on the stream, after compute_done, then record its slot's event.
  // Engine thread, lock NOT held (staging a pageable source is a memcpy of a whole expert).
  std::string issue(Item& it, int buffer) {
    if (buffer >= 0) {
      Staging& b = staging[buffer];
      std::string err = grow(b, it.bytes());
      if (!err.empty()) return err;
      size_t off = 0;
      for (int i = 0; i < it.nseg; ++i) {
        std::memcpy(b.ptr + off, it.seg[i].src, it.seg[i].bytes);
        it.seg[i].src = b.ptr + off;
        off += it.seg[i].bytes;
      }
    }
#ifndef MOECHAT_HOST_BACKEND
    CUDA_TRY(cudaStreamWaitEvent(stream, compute_done, 0));  // a never-recorded event: no wait
    for (int i = 0; i < it.nseg; ++i)
      CUDA_TRY(cudaMemcpyAsync(it.seg[i].dst, it.seg[i].src, it.seg[i].bytes, cudaMemcpyHostToDevice, stream));
    CUDA_TRY(cudaEventRecord(slots[it.slot].ready, stream));
#endif
    return "";
  }

  void record(const Item& it) {  // lock held, right after issue()
#ifdef MOECHAT_HOST_BACKEND
    HostOp op{it.slot, it.nseg, {}};
    std::copy(it.seg, it.seg + it.nseg, op.seg);
    stream.push_back(op);
    slots[it.slot].recorded++;
#else
    (void)it;
#endif
  }

  // The slot's readiness event: has its latest recorded copy completed? Lock held.
  int event_done(Slot& s) {
#ifdef MOECHAT_HOST_BACKEND
    return s.executed == s.recorded;
#else
    cudaError_t err = cudaEventQuery(s.ready);
    if (err == cudaSuccess) return 1;
    if (err == cudaErrorNotReady) return 0;
    fail(cuda_error("cudaEventQuery", err));
    return -1;
#endif
  }

  // Host backend: run the host stream (unless held; destroy ignores hold). Lock held, released per copy.
  void progress(std::unique_lock<std::mutex>& lk, bool force) {
#ifdef MOECHAT_HOST_BACKEND
    while (!stream.empty() && (force || !hold)) {
      HostOp op = stream.front();
      stream.pop_front();
      lk.unlock();
      for (int i = 0; i < op.nseg; ++i) std::memcpy(op.seg[i].dst, op.seg[i].src, op.seg[i].bytes);
      lk.lock();
      slots[op.slot].executed++;
    }
#else
    (void)lk;
    (void)force;
#endif
  }

  // --- queues --------------------------------------------------------------------------------
  void fail(const std::string& msg) {  // lock held
    if (error.empty()) error = msg;
    work.notify_all();
    idle.notify_all();
  }

  bool is_idle() const { return queued == 0 && flights.empty(); }

  bool drop_queued(int slot) {  // lock held
    Slot& s = slots[slot];
    if (!s.queued) return false;
    std::deque<Item>& q = queues[s.level];
    for (auto it = q.begin(); it != q.end(); ++it)
      if (it->seq == s.queued) {
        q.erase(it);
        break;
      }
    s.queued = 0;
    queued--;
    stats.cancelled++;
    if (is_idle()) idle.notify_all();
    return true;
  }

  void drop_all() {  // lock held
    for (int slot = 0; slot < nslots; ++slot) drop_queued(slot);
  }

  bool pop(Item& out) {  // lock held: highest level first, FIFO within a level
    for (int level = nlevels - 1; level >= 0; --level)
      if (!queues[level].empty()) {
        out = queues[level].front();
        queues[level].pop_front();
        queued--;
        slots[out.slot].queued = 0;
        return true;
      }
    return false;
  }

  int free_staging() const {
    for (size_t i = 0; i < staging.size(); ++i)
      if (!staging[i].busy) return static_cast<int>(i);
    return -1;  // cannot happen: at most max_inflight flights, one buffer each
  }

  // --- engine thread -------------------------------------------------------------------------
  void issue_next(std::unique_lock<std::mutex>& lk) {
    Item it{};
    pop(it);
    Slot& s = slots[it.slot];
    s.issuing++;
    int buffer = it.pinned ? -1 : free_staging();
    if (buffer >= 0) staging[buffer].busy = true;
    if (flights.empty()) busy_since = Clock::now();
    flights.push_back(Flight{it, buffer, false});
    Flight& f = flights.back();  // stable: only this thread changes flights
    if (log.size() < LOG_CAP) log.push_back(it.slot);
    lk.unlock();
    std::string err = issue(it, buffer);
    lk.lock();
    s.issuing--;
    if (!err.empty()) return fail(err);
    record(it);
    f.issued = s.issued = true;
  }

  void retire() {  // lock held: completed flights, oldest first (one stream completes in order)
    bool had = !flights.empty();
    while (!flights.empty() && error.empty()) {
      Flight& f = flights.front();
      if (!f.issued || event_done(slots[f.item.slot]) != 1) break;
      stats.bytes += f.item.bytes();
      stats.copies++;
      if (f.staging >= 0) {
        stats.staged_bytes += f.item.bytes();
        staging[f.staging].busy = false;
      }
      flights.pop_front();
    }
    if (had && flights.empty()) stats.busy_s += std::chrono::duration<double>(Clock::now() - busy_since).count();
    if (is_idle()) idle.notify_all();
  }

  void wait(std::unique_lock<std::mutex>& lk) {  // lock held: sleep until there may be work
#ifdef MOECHAT_HOST_BACKEND
    work.wait(lk);  // every change that makes progress possible notifies
#else
    if (flights.empty() || !error.empty()) {
      work.wait(lk);
    } else if (static_cast<int>(flights.size()) >= max_inflight) {
      cudaEvent_t ev = slots[flights.front().item.slot].ready;  // only this thread records it
      lk.unlock();
      cudaEventSynchronize(ev);  // errors surface in retire's query
      lk.lock();
    } else {  // copies in flight, room for more: poll them, wake at once for new work
      work.wait_for(lk, std::chrono::microseconds(50));
    }
#endif
  }

  void drain(std::unique_lock<std::mutex>& lk) {  // destroy: let issued copies finish
    progress(lk, true);
#ifndef MOECHAT_HOST_BACKEND
    lk.unlock();
    cudaStreamSynchronize(stream);
    lk.lock();
#endif
    retire();
    flights.clear();
  }

  void run() {
    std::string err = init();
    std::unique_lock<std::mutex> lk(mu);
    error = err;
    started = true;
    idle.notify_all();  // create() waits on it
    if (!err.empty()) {
      lk.unlock();
      return release();
    }
    for (;;) {
      progress(lk, false);
      retire();
      if (stop) break;
      if (!error.empty()) drop_all();
      if (error.empty() && !paused && queued && static_cast<int>(flights.size()) < max_inflight) {
        issue_next(lk);
        continue;
      }
      wait(lk);
    }
    drop_all();
    drain(lk);
    idle.notify_all();
    lk.unlock();
    release();
  }
};

namespace {

int bad(const std::string& msg) {
  t_error = msg;
  return BAD_ARGUMENT;
}

int failed(Engine* e) {  // lock held
  t_error = e->error;
  return FAILED;
}

}  // namespace

API const char* moechat_pf_last_error() { return t_error.c_str(); }

// device: CUDA ordinal (ignored by the host backend); num_slots: pool size; num_levels: priority
// levels 0..num_levels-1; max_inflight: copies issued but not complete. NULL on failure.
API void* moechat_pf_create(int device, int num_slots, int num_levels, int max_inflight) {
  if (num_slots < 1 || num_levels < 1 || max_inflight < 1) {
    bad("num_slots, num_levels and max_inflight must each be at least 1");
    return nullptr;
  }
  Engine* e = new Engine(device, num_slots, num_levels, max_inflight);
  e->thread = std::thread([e] { e->run(); });
  std::string err;
  {
    std::unique_lock<std::mutex> lk(e->mu);
    e->idle.wait(lk, [e] { return e->started; });
    err = e->error;
  }
  if (!err.empty()) {
    e->thread.join();
    delete e;
    t_error = err;
    return nullptr;
  }
  return e;
}

// Drops queued items, waits for issued copies, ends the thread, frees everything.
API void moechat_pf_destroy(void* h) {
  Engine* e = static_cast<Engine*>(h);
  if (!e) return;
  {
    std::lock_guard<std::mutex> lk(e->mu);
    e->stop = true;
    e->work.notify_all();
  }
  e->thread.join();
  delete e;
}

// One expert into `slot`: nseg segments (srcs[i] host, dsts[i] device, bytes[i]), 1..MAX_SEGMENTS.
// pinned: the sources are page-locked (else they are staged). A queued item for the same slot is replaced.
API int moechat_pf_enqueue(void* h, int slot, int layer, int level, int nseg, const void* const* srcs,
                           void* const* dsts, const size_t* bytes, int pinned) {
  Engine* e = static_cast<Engine*>(h);
  if (!e) return bad("the prefetch engine is closed");
  if (slot < 0 || slot >= e->nslots) return bad("slot " + std::to_string(slot) + " out of range");
  if (level < 0 || level >= e->nlevels) return bad("level " + std::to_string(level) + " out of range");
  if (nseg < 1 || nseg > MAX_SEGMENTS) return bad("an item is 1.." + std::to_string(MAX_SEGMENTS) + " copies");
  Item it{};
  for (int i = 0; i < nseg; ++i) {
    if (!srcs[i] || !dsts[i] || !bytes[i]) return bad("a copy segment without pointers or bytes");
    it.seg[i] = Segment{static_cast<const uint8_t*>(srcs[i]), static_cast<uint8_t*>(dsts[i]), bytes[i]};
  }
  it.slot = slot;
  it.layer = layer;
  it.level = level;
  it.pinned = pinned != 0;
  it.nseg = nseg;
  std::lock_guard<std::mutex> lk(e->mu);
  if (!e->error.empty()) return failed(e);
  e->drop_queued(slot);
  it.seq = e->next_seq++;
  e->queues[level].push_back(it);
  e->queued++;
  e->slots[slot].queued = it.seq;
  e->slots[slot].level = level;
  e->work.notify_one();
  return 0;
}

// IDLE (never written), QUEUED, IN_FLIGHT (issued, not complete) or READY (its latest copy
// completed); -2 when the engine failed.
API int moechat_pf_query(void* h, int slot) {
  Engine* e = static_cast<Engine*>(h);
  if (!e) return bad("the prefetch engine is closed");
  if (slot < 0 || slot >= e->nslots) return bad("slot " + std::to_string(slot) + " out of range");
  std::lock_guard<std::mutex> lk(e->mu);
  if (!e->error.empty()) return failed(e);
  Slot& s = e->slots[slot];
  if (s.queued) return QUEUED;
  if (s.issuing) return IN_FLIGHT;
  if (!s.issued) return IDLE;
  int done = e->event_done(s);
  if (done < 0) return failed(e);
  return done ? READY : IN_FLIGHT;
}

// Drops the slot's queued item; 1 when there was one, 0 when none (idle, in flight or done).
API int moechat_pf_cancel(void* h, int slot) {
  Engine* e = static_cast<Engine*>(h);
  if (!e) return bad("the prefetch engine is closed");
  if (slot < 0 || slot >= e->nslots) return bad("slot " + std::to_string(slot) + " out of range");
  std::lock_guard<std::mutex> lk(e->mu);
  return e->drop_queued(slot) ? 1 : 0;
}

// Drops the queued items of `layer` below level `tau`; writes their slots to out (room for
// num_slots: at most one queued item per slot) and returns how many.
API int moechat_pf_cancel_below(void* h, int layer, int tau, int32_t* out, int cap) {
  Engine* e = static_cast<Engine*>(h);
  if (!e) return bad("the prefetch engine is closed");
  if (cap < e->nslots) return bad("cancel_below needs room for num_slots slots");
  std::lock_guard<std::mutex> lk(e->mu);
  int n = 0;
  for (int level = 0; level < tau && level < e->nlevels; ++level)
    for (const Item& it : e->queues[level])
      if (it.layer == layer) out[n++] = it.slot;
  for (int i = 0; i < n; ++i) e->drop_queued(out[i]);
  return n;
}

// Records compute_done on `stream` (a cudaStream_t, e.g. torch.cuda.current_stream().cuda_stream):
// every copy issued from now on waits for the work queued there so far.
API int moechat_pf_mark_compute(void* h, void* stream) {
  Engine* e = static_cast<Engine*>(h);
  if (!e) return bad("the prefetch engine is closed");
#ifdef MOECHAT_HOST_BACKEND
  (void)e;
  (void)stream;
#else
  int current = -1;
  cudaGetDevice(&current);
  if (current != e->device) cudaSetDevice(e->device);
  cudaError_t err = cudaEventRecord(e->compute_done, static_cast<cudaStream_t>(stream));
  if (current != e->device && current >= 0) cudaSetDevice(current);
  if (err != cudaSuccess) {
    t_error = cuda_error("cudaEventRecord(compute_done)", err);
    return FAILED;
  }
#endif
  return 0;
}

// Stop issuing (queued items wait) or resume.
API void moechat_pf_pause(void* h, int on) {
  Engine* e = static_cast<Engine*>(h);
  if (!e) return;
  std::lock_guard<std::mutex> lk(e->mu);
  e->paused = on != 0;
  e->work.notify_all();
}

#ifdef MOECHAT_HOST_BACKEND
// Host backend only: stall the host stream (issued copies stay in flight), like a busy compute
// stream stalls copies waiting on compute_done.
API void moechat_pf_hold(void* h, int on) {
  Engine* e = static_cast<Engine*>(h);
  if (!e) return;
  std::lock_guard<std::mutex> lk(e->mu);
  e->hold = on != 0;
  e->work.notify_all();
}
#endif

// 0 once nothing is queued or in flight, 1 after timeout_s, -2 when the engine failed.
API int moechat_pf_wait_idle(void* h, double timeout_s) {
  Engine* e = static_cast<Engine*>(h);
  if (!e) return bad("the prefetch engine is closed");
  std::unique_lock<std::mutex> lk(e->mu);
  bool idle = e->idle.wait_for(lk, std::chrono::duration<double>(timeout_s),
                               [e] { return !e->error.empty() || e->is_idle(); });
  if (!e->error.empty()) return failed(e);
  return idle ? 0 : 1;
}

API int moechat_pf_counters(void* h, Counters* out) {
  Engine* e = static_cast<Engine*>(h);
  if (!e) return bad("the prefetch engine is closed");
  std::lock_guard<std::mutex> lk(e->mu);
  *out = e->stats;
  out->queued = e->queued;
  out->in_flight = e->flights.size();
  if (!e->flights.empty()) out->busy_s += std::chrono::duration<double>(Clock::now() - e->busy_since).count();
  return 0;
}

// Moves up to cap slots, in the order their copies were issued, into out; returns how many.
API int moechat_pf_issued(void* h, int32_t* out, int cap) {
  Engine* e = static_cast<Engine*>(h);
  if (!e) return bad("the prefetch engine is closed");
  std::lock_guard<std::mutex> lk(e->mu);
  int n = static_cast<int>(std::min(e->log.size(), static_cast<size_t>(cap < 0 ? 0 : cap)));
  std::copy(e->log.begin(), e->log.begin() + n, out);
  e->log.erase(e->log.begin(), e->log.begin() + n);
  return n;
}
