// Linked into every test labelled gpu: on SIGSEGV, SIGBUS, SIGILL, SIGFPE or SIGABRT the
// process prints the signal and a backtrace (module(+offset) [address] per frame; the
// executables export their symbols) to stderr, then dies of the same signal, so a crash on
// a machine without a debugger still says where it happened. A line on stderr marks the
// end of the tests, so a crash after it is known to happen during exit (static
// destructors, atexit handlers, library teardown).
//
// The unwinder stops at a program counter outside every loaded module (a call through a
// null or dangling function pointer), so the backtrace then ends at the handler. For that
// case the handler also prints the faulting thread (main or not), the program counter and
// stack pointer, the caller's return address (x86-64: the word at the stack pointer, which
// the call instruction pushed; AArch64: the link register) and the words near the stack
// pointer that may be return addresses (a rough backtrace; stale words may appear).
#include <dlfcn.h>
#include <execinfo.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};

void Write(const char* s) {
  const ssize_t r = write(STDERR_FILENO, s, std::strlen(s));
  (void)r;
}

// True when `p` lies inside a loaded module (the executable or a shared library).
bool InModule(const void* p) {
  Dl_info info;
  return p != nullptr && dladdr(p, &info) != 0 && info.dli_fname != nullptr;
}

// True when `p` may be a return address: inside a module and not the start of a symbol
// (which a pushed return address never is, but a stored function or object pointer is).
bool MaybeReturnAddress(const void* p) {
  Dl_info info;
  return p != nullptr && dladdr(p, &info) != 0 && info.dli_fname != nullptr && info.dli_saddr != p;
}

// The registers of the interrupted context that locate a bad call; false where unknown.
bool CallSite(const void* context, uintptr_t* pc, uintptr_t* sp, uintptr_t* caller) {
  const ucontext_t* uc = static_cast<const ucontext_t*>(context);
  if (uc == nullptr) return false;
#if defined(__x86_64__)
  *pc = uintptr_t(uc->uc_mcontext.gregs[REG_RIP]);
  *sp = uintptr_t(uc->uc_mcontext.gregs[REG_RSP]);
  // At the first instruction of the callee the call's return address is at the stack pointer.
  *caller = *sp != 0 ? *reinterpret_cast<const uintptr_t*>(*sp) : 0;
  return true;
#elif defined(__aarch64__)
  *pc = uintptr_t(uc->uc_mcontext.pc);
  *sp = uintptr_t(uc->uc_mcontext.sp);
  *caller = uintptr_t(uc->uc_mcontext.regs[30]);
  return true;
#else
  return false;
#endif
}

// For a program counter outside every module: the caller, then code addresses on the stack.
void WriteCallSite(const void* context) {
  uintptr_t pc = 0, sp = 0, caller = 0;
  if (!CallSite(context, &pc, &sp, &caller)) return;
  char line[200];
  std::snprintf(line, sizeof line, "*** pc %p, sp %p\n", reinterpret_cast<void*>(pc),
                reinterpret_cast<void*>(sp));
  Write(line);
  if (InModule(reinterpret_cast<void*>(pc))) return;
  Write("*** the pc is outside every loaded module (a call through a null or dangling pointer); "
        "the caller's return address:\n");
  void* c = reinterpret_cast<void*>(caller);
  backtrace_symbols_fd(&c, 1, STDERR_FILENO);
  if (sp == 0) return;
  Write("*** words among the 64 at the stack pointer that may be return addresses "
        "(innermost first):\n");
  const uintptr_t* stack = reinterpret_cast<const uintptr_t*>(sp);
  for (int i = 0; i < 64; ++i) {
    void* w = reinterpret_cast<void*>(stack[i]);
    if (MaybeReturnAddress(w)) backtrace_symbols_fd(&w, 1, STDERR_FILENO);
  }
}

void OnSignal(int sig, siginfo_t* info, void* context) {
  char line[200];
  const long tid = syscall(SYS_gettid);
  std::snprintf(line, sizeof line,
                "\n*** signal %d (%s), fault address %p, thread %ld (%s); backtrace:\n", sig,
                strsignal(sig), info != nullptr ? info->si_addr : nullptr, tid,
                tid == long(getpid()) ? "the main thread" : "not the main thread");
  Write(line);
  void* frames[128];
  const int n = backtrace(frames, 128);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  WriteCallSite(context);
  Write("*** end of backtrace\n");
  // Die of the same signal with the default action (exit status 128 + sig, core if enabled).
  signal(sig, SIG_DFL);
  raise(sig);
}

class ExitMarker : public ::testing::Environment {
 public:
  void TearDown() override { Write("[crash handler] all tests done; the process now exits\n"); }
};

struct Install {
  Install() {
    // backtrace() loads libgcc on its first call: do it now, not inside the handler.
    void* warm[4];
    (void)backtrace(warm, 4);
    static char alt[1 << 16];  // a stack for the handler, in case the stack overflowed
    stack_t ss = {};
    ss.ss_sp = alt;
    ss.ss_size = sizeof alt;
    (void)sigaltstack(&ss, nullptr);
    struct sigaction sa = {};
    sa.sa_sigaction = OnSignal;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESETHAND;
    sigemptyset(&sa.sa_mask);
    for (int s : kSignals) (void)sigaction(s, &sa, nullptr);
    ::testing::AddGlobalTestEnvironment(new ExitMarker);
  }
};

const Install install;

}  // namespace
