// The pathways:: collectives inside an XLA executable: XLA FFI handlers that call the executor's own gloo (or
// NCCL) group through torch's c10d Backend, on copies of the executable's buffers (an op given up on outlives
// them: `view`), with no Python and no host stage.
//
// Built from this file by torch.utils.cpp_extension against the installed torch and jaxlib headers
// (executor/backends/xla_collectives.py). State is per process, as the executor is:
// - groups: slot -> the c10d Backend of a formed group, its abandoned flag and reason, and the ops given up on;
// - the binding: mesh axis id -> slot (or why the axis has no usable group), set by the compute thread before
//   it calls an executable. XLA may run a custom call on one of its own threads, so the binding is not
//   thread-local; one compute thread per executor calls executables, one at a time.
//
// Every handler takes and returns an int32 "order" scalar besides its data, so that the collectives of one
// executable run in graph order on every member (XLA schedules independent side-effecting calls freely).

#include "../../native/shm_collectives.h"

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Group {
  c10::intrusive_ptr<c10d::Backend> backend;   // or, for members of one host, the library's group:
  void* host = nullptr;                         // its handle (executor/native/shm_collectives.cpp)
  pw_coll_run_fn host_run = nullptr;
  double host_timeout_s = 60.0;
  int rank = 0;
  int size = 1;
  std::atomic<bool> abandoned{false};
  std::mutex mutex;                                   // reason and pending
  std::string reason;
  std::vector<c10::intrusive_ptr<c10d::Work>> pending;  // given up on while abandoned: they may still run
};

struct Bound {
  int64_t slot = -1;
  bool abandoned = false;   // the axis's group was abandoned before this binding (a CollectiveAbandoned)
  std::string reason;       // why slot is -1
};

constexpr int kMaxAxes = 64;
constexpr std::chrono::milliseconds kWaitSlice(200);  // as executor.collectives._WAIT_SLICE

std::mutex groups_mutex;
std::unordered_map<int64_t, std::shared_ptr<Group>> groups;
int64_t next_slot = 0;
Bound binding[kMaxAxes];

std::shared_ptr<Group> find_group(int64_t slot) {
  std::lock_guard<std::mutex> lock(groups_mutex);
  auto found = groups.find(slot);
  return found == groups.end() ? nullptr : found->second;
}

ffi::Error aborted(const std::string& what) { return ffi::Error(ffi::ErrorCode::kAborted, what); }

ffi::Error failed(const std::string& what) { return ffi::Error(ffi::ErrorCode::kFailedPrecondition, what); }

// The group bound to `axis`, or the error a collective on it raises (its text reaches the executor).
ffi::Error bound_group(const char* name, int64_t axis, std::shared_ptr<Group>* out) {
  if (axis < 0 || axis >= kMaxAxes) return failed(std::string(name) + ": axis id out of range");
  const Bound& bound = binding[axis];
  if (bound.slot < 0) {
    std::string why = std::string(name) + ": " +
        (bound.reason.empty() ? "no process group bound for this axis (a collective outside a bound computation)"
                              : bound.reason);
    return bound.abandoned ? aborted(why) : failed(why);
  }
  auto group = find_group(bound.slot);
  if (!group) return failed(std::string(name) + ": the axis's process group was released");
  if (group->abandoned.load()) {
    std::lock_guard<std::mutex> lock(group->mutex);
    return aborted(std::string(name) + ": collective abandoned: " + group->reason);
  }
  *out = group;
  return ffi::Error::Success();
}

// Wait in slices, so that abandoning the group ends the wait within one slice (as _Group.wait in Python).
ffi::Error wait(Group& group, const c10::intrusive_ptr<c10d::Work>& work) {
  while (true) {
    try {
      work->wait(kWaitSlice);
      return ffi::Error::Success();
    } catch (const std::exception& error) {
      if (work->isCompleted()) {
        try {
          work->wait();   // its own outcome, not the slice's timeout
          return ffi::Error::Success();
        } catch (const std::exception& own) {
          return ffi::Error::Internal(own.what());
        }
      }
      if (group.abandoned.load()) {
        std::lock_guard<std::mutex> lock(group.mutex);
        group.pending.push_back(work);
        return aborted("collective abandoned: " + group.reason);
      }
    }
  }
}

c10::ScalarType scalar_type(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F32: return c10::ScalarType::Float;
    case ffi::DataType::F64: return c10::ScalarType::Double;
    case ffi::DataType::F16: return c10::ScalarType::Half;
    case ffi::DataType::BF16: return c10::ScalarType::BFloat16;
    case ffi::DataType::S64: return c10::ScalarType::Long;
    case ffi::DataType::S32: return c10::ScalarType::Int;
    case ffi::DataType::S8: return c10::ScalarType::Char;
    case ffi::DataType::U8: return c10::ScalarType::Byte;
    case ffi::DataType::PRED: return c10::ScalarType::Bool;
    default: return c10::ScalarType::Undefined;
  }
}

// A CPU tensor over an FFI buffer's bytes (no copy), in the buffer's dtype and shape. Never given to gloo: an op
// given up on (an abandoned group) still runs after the handler returns, and XLA frees the executable's buffers
// when the call fails. gloo gets tensors of its own (`owned`), which its Work keeps alive while it runs.
at::Tensor view(void* data, ffi::DataType type, const std::vector<int64_t>& shape) {
  return at::from_blob(data, shape, at::TensorOptions().dtype(scalar_type(type)).device(at::kCPU));
}

// A copy of `tensor` in memory torch owns: what a collective reads and writes (see `view`).
at::Tensor owned(const at::Tensor& tensor) { return tensor.clone(at::MemoryFormat::Contiguous); }

std::vector<int64_t> shape_of(const ffi::AnyBuffer& buffer) {
  auto dims = buffer.dimensions();
  return std::vector<int64_t>(dims.begin(), dims.end());
}

enum Reduce : int64_t { kSum = 0, kMean = 1, kMax = 2 };

c10d::ReduceOp reduce_op(int64_t op) { return op == kMax ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM; }

void pass_order(ffi::AnyBuffer order_in, ffi::Result<ffi::AnyBuffer> order_out) {
  std::memcpy(order_out->untyped_data(), order_in.untyped_data(), order_in.size_bytes());
}

// What every handler starts with: the order scalar passed on, the group bound to the axis, a dtype gloo takes.
ffi::Error prepare(const char* name, int64_t axis, ffi::AnyBuffer& x, ffi::AnyBuffer& order_in,
                   ffi::Result<ffi::AnyBuffer>& order_out, std::shared_ptr<Group>* group) {
  pass_order(order_in, order_out);
  if (auto error = bound_group(name, axis, group); error.failure()) return error;
  if (scalar_type(x.element_type()) == c10::ScalarType::Undefined)
    return failed(std::string(name) + ": an element type gloo does not take");
  return ffi::Error::Success();
}

// A gathered or scattered buffer's leading dimension is the group's size it was traced for.
ffi::Error check_members(const char* name, const std::vector<int64_t>& shape, const Group& group) {
  if (!shape.empty() && shape[0] == group.size) return ffi::Error::Success();
  return failed(std::string(name) + ": the executable was traced for a group of " +
                std::to_string(shape.empty() ? 0 : shape[0]) + " members, the bound group has " +
                std::to_string(group.size));
}

// `body` with a C++ exception (torch's, gloo's) as the handler's error: none may cross into XLA.
template <typename Body>
ffi::Error guarded(const char* name, Body body) {
  try {
    return body();
  } catch (const std::exception& error) {
    return ffi::Error::Internal(std::string(name) + ": " + error.what());
  }
}

int32_t host_dtype(ffi::DataType type) {   // the library's ids (pw_coll_op.dtype)
  switch (type) {
    case ffi::DataType::F32: return 0;
    case ffi::DataType::F64: return 1;
    case ffi::DataType::F16: return 2;
    case ffi::DataType::BF16: return 3;
    case ffi::DataType::S8: return 4;
    case ffi::DataType::U8: return 5;
    case ffi::DataType::S16: return 6;
    case ffi::DataType::S32: return 7;
    case ffi::DataType::S64: return 8;
    default: return 9;   // PRED: `prepare` let through only what scalar_type knows
  }
}

// One collective of a host group, run here on the executable's own buffers (it never outlives the call); the
// mean's division after it.
ffi::Error on_host(const char* name, const Group& group, int32_t kind, int64_t op, const ffi::AnyBuffer& x, void* out,
                   uint64_t count) {
  pw_coll_op request{kind, host_dtype(x.element_type()), op == kMax ? 1 : 0, 0, count, 0, x.untyped_data(), out,
                     group.host_timeout_s};
  char why[512];
  int code = group.host_run(group.host, &request, why, sizeof why);
  if (code == -ECANCELED) return aborted(std::string(name) + ": " + why);
  if (code != 0) return failed(std::string(name) + ": " + why);
  return ffi::Error::Success();
}

// all_reduce(x) -> y, the reduction over the axis's group (mean: the sum divided by the group's size).
ffi::Error AllReduceImpl(ffi::AnyBuffer x, ffi::AnyBuffer order_in, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::AnyBuffer> order_out, int64_t axis, int64_t op) {
  std::shared_ptr<Group> group;
  if (auto error = prepare("all_reduce", axis, x, order_in, order_out, &group); error.failure()) return error;
  return guarded("all_reduce", [&]() {
    if (group->host != nullptr) {
      auto error = on_host("all_reduce", *group, 1, op, x, y->untyped_data(), x.element_count());
      if (!error.failure() && op == kMean) view(y->untyped_data(), x.element_type(), shape_of(x)).div_(group->size);
      return error;
    }
    std::vector<at::Tensor> tensors{owned(view(x.untyped_data(), x.element_type(), shape_of(x)))};
    c10d::AllreduceOptions options;
    options.reduceOp = reduce_op(op);
    if (auto error = wait(*group, group->backend->allreduce(tensors, options)); error.failure()) return error;
    if (op == kMean) tensors[0].div_(group->size);
    view(y->untyped_data(), x.element_type(), shape_of(x)).copy_(tensors[0]);
    return ffi::Error::Success();
  });
}

// all_gather(x) -> y of shape (size, *x.shape): member i's x at y[i] (the jax side moves the axis where asked).
ffi::Error AllGatherImpl(ffi::AnyBuffer x, ffi::AnyBuffer order_in, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::AnyBuffer> order_out, int64_t axis) {
  std::shared_ptr<Group> group;
  if (auto error = prepare("all_gather", axis, x, order_in, order_out, &group); error.failure()) return error;
  auto out_shape = shape_of(*y);
  if (auto error = check_members("all_gather", out_shape, *group); error.failure()) return error;
  return guarded("all_gather", [&]() {
    if (group->host != nullptr) return on_host("all_gather", *group, 2, kSum, x, y->untyped_data(), x.element_count());
    std::vector<at::Tensor> inputs{owned(view(x.untyped_data(), x.element_type(), shape_of(x)))};
    at::Tensor gathered = at::empty(out_shape, inputs[0].options());
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int i = 0; i < group->size; ++i) outputs[0].push_back(gathered[i]);
    if (auto error = wait(*group, group->backend->allgather(outputs, inputs)); error.failure()) return error;
    view(y->untyped_data(), x.element_type(), out_shape).copy_(gathered);
    return ffi::Error::Success();
  });
}

// reduce_scatter(x of shape (size, *chunk)) -> y of shape chunk: this member's chunk of the reduction.
ffi::Error ReduceScatterImpl(ffi::AnyBuffer x, ffi::AnyBuffer order_in, ffi::Result<ffi::AnyBuffer> y,
                             ffi::Result<ffi::AnyBuffer> order_out, int64_t axis, int64_t op) {
  std::shared_ptr<Group> group;
  if (auto error = prepare("reduce_scatter", axis, x, order_in, order_out, &group); error.failure()) return error;
  auto in_shape = shape_of(x);
  if (auto error = check_members("reduce_scatter", in_shape, *group); error.failure()) return error;
  return guarded("reduce_scatter", [&]() {
    if (group->host != nullptr) {
      auto error = on_host("reduce_scatter", *group, 3, op, x, y->untyped_data(), y->element_count());
      if (!error.failure() && op == kMean) view(y->untyped_data(), x.element_type(), shape_of(*y)).div_(group->size);
      return error;
    }
    at::Tensor chunks = owned(view(x.untyped_data(), x.element_type(), in_shape));
    at::Tensor out = at::empty(shape_of(*y), chunks.options());
    auto type = chunks.scalar_type();
    if (op == kMax || !(type == c10::ScalarType::Float || type == c10::ScalarType::Double)) {
      // gloo's reduce_scatter does not take every dtype on CPU (executor.collectives does the same).
      std::vector<at::Tensor> whole{chunks};
      c10d::AllreduceOptions options;
      options.reduceOp = reduce_op(op);
      if (auto error = wait(*group, group->backend->allreduce(whole, options)); error.failure()) return error;
      out.copy_(whole[0][group->rank]);
    } else {
      std::vector<at::Tensor> outputs{out};
      std::vector<std::vector<at::Tensor>> inputs(1);
      for (int i = 0; i < group->size; ++i) inputs[0].push_back(chunks[i]);
      c10d::ReduceScatterOptions options;
      options.reduceOp = c10d::ReduceOp::SUM;
      if (auto error = wait(*group, group->backend->reduce_scatter(outputs, inputs, options)); error.failure())
        return error;
    }
    if (op == kMean) out.div_(group->size);
    view(y->untyped_data(), x.element_type(), shape_of(*y)).copy_(out);
    return ffi::Error::Success();
  });
}

}  // namespace

// Every handler: (data, order in) -> (data, order out), and the axis id it runs on.
auto collective_binding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Attr<int64_t>("axis");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(PathwaysAllReduce, AllReduceImpl, collective_binding().Attr<int64_t>("op"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(PathwaysAllGather, AllGatherImpl, collective_binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(PathwaysReduceScatter, ReduceScatterImpl, collective_binding().Attr<int64_t>("op"));

namespace {

int64_t register_group(const c10::intrusive_ptr<c10d::Backend>& backend) {
  auto group = std::make_shared<Group>();
  group->backend = backend;
  group->rank = backend->getRank();
  group->size = backend->getSize();
  std::lock_guard<std::mutex> lock(groups_mutex);
  groups[next_slot] = group;
  return next_slot++;
}

// A group of one host's members (executor/shm_group.py): its handle in the library and the library's run.
int64_t register_host_group(int64_t handle, int64_t run, int rank, int size, double timeout_s) {
  auto group = std::make_shared<Group>();
  group->host = reinterpret_cast<void*>(handle);
  group->host_run = reinterpret_cast<pw_coll_run_fn>(run);
  group->host_timeout_s = timeout_s;
  group->rank = rank;
  group->size = size;
  std::lock_guard<std::mutex> lock(groups_mutex);
  groups[next_slot] = group;
  return next_slot++;
}

void abandon(int64_t slot, const std::string& reason) {
  auto group = find_group(slot);
  if (!group) return;
  {
    std::lock_guard<std::mutex> lock(group->mutex);
    group->reason = reason;
  }
  group->abandoned.store(true);
}

bool quiet(int64_t slot) {
  auto group = find_group(slot);
  if (!group) return true;
  std::lock_guard<std::mutex> lock(group->mutex);
  for (auto& work : group->pending)
    if (!work->isCompleted()) return false;
  return true;
}

void release(int64_t slot) {
  std::shared_ptr<Group> group;
  {
    std::lock_guard<std::mutex> lock(groups_mutex);
    auto found = groups.find(slot);
    if (found == groups.end()) return;
    group = found->second;
    groups.erase(found);
  }
  // Dropping the backend joins gloo's threads: outside the table's lock.
  py::gil_scoped_release no_gil;
  group.reset();
}

// axis id -> (slot, abandoned, reason); every axis not named is unbound.
void bind_axes(const std::vector<std::tuple<int64_t, int64_t, bool, std::string>>& axes) {
  for (auto& bound : binding) bound = Bound();
  for (const auto& [axis, slot, was_abandoned, reason] : axes) {
    if (axis < 0 || axis >= kMaxAxes) throw std::out_of_range("axis id " + std::to_string(axis));
    binding[axis] = Bound{slot, was_abandoned, reason};
  }
}

py::capsule capsule(void* handler) { return py::capsule(handler); }

// A native crash's C++ frames, in the process's stderr (an executor's log), before the Python stacks that the
// handler found installed (faulthandler's: pathways_torch/wire/crash_stacks.py) writes. Python 3.11's faulthandler
// writes no C frame, and a crash inside a custom call or gloo's thread showed no frame of ours (issue 47).
constexpr int kFatalSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
struct sigaction chained[NSIG];   // the handler before ours, per signal

void write_stderr(const char* text) {
  ssize_t ignored = write(2, text, std::strlen(text));   // async-signal-safe, unlike stdio
  (void)ignored;
}

void native_stack(int signum, siginfo_t* info, void* context) {
  write_stderr("\nFatal signal: native stack (C++ frames; addr2line -fCe LIBRARY +OFFSET names a frame):\n");
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), 2);
  const struct sigaction previous = chained[signum];
  sigaction(signum, &previous, nullptr);   // from here the handler before ours has the signal
  if (previous.sa_flags & SA_SIGINFO) {
    if (previous.sa_sigaction != nullptr) previous.sa_sigaction(signum, info, context);
  } else if (previous.sa_handler == SIG_DFL) {
    raise(signum);   // blocked until this returns; then the default action ends the process
  } else if (previous.sa_handler != SIG_IGN) {
    previous.sa_handler(signum);   // faulthandler's: the Python stacks, then the signal again, by default
  }
}

void install_native_stacks() {
  static bool installed = false;
  if (installed) return;
  installed = true;
  void* warm[1];
  backtrace(warm, 1);   // loads libgcc's unwinder now: a first call inside a signal handler may allocate
  struct sigaction ours = {};
  ours.sa_sigaction = native_stack;
  ours.sa_flags = SA_SIGINFO | SA_ONSTACK;   // faulthandler's alternate stack, for a stack overflow
  sigemptyset(&ours.sa_mask);
  for (int signum : kFatalSignals) sigaction(signum, &ours, &chained[signum]);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pathways:: collectives as XLA FFI custom calls into the executor's c10d groups";
  install_native_stacks();
  m.def("register_group", &register_group, "keep a formed group; returns its slot");
  m.def("register_host_group", &register_host_group,
        "keep a host group (its library handle and pw_coll_run's address, rank, size, timeout); returns its slot");
  m.def("abandon", &abandon, "mark a group abandoned: collectives on it fail within one wait slice");
  m.def("quiet", &quiet, "no op given up on still runs in the group");
  m.def("release", &release, "let the group go");
  m.def("bind", &bind_axes, "bind mesh axis ids to slots (or to why they have no group) for the next executables");
  m.def("max_axes", []() { return kMaxAxes; });
  m.def("handlers", []() {
    py::dict out;
    out["pathways_all_reduce"] = capsule(reinterpret_cast<void*>(PathwaysAllReduce));
    out["pathways_all_gather"] = capsule(reinterpret_cast<void*>(PathwaysAllGather));
    out["pathways_reduce_scatter"] = capsule(reinterpret_cast<void*>(PathwaysReduceScatter));
    return out;
  });
}
