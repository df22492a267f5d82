// Linked into every test labelled gpu: on SIGSEGV, SIGBUS, SIGILL, SIGFPE or SIGABRT the
// process prints the signal and a backtrace (module(+offset) [address] per frame; the
// executables export their symbols) to stderr, then dies of the same signal, so a crash on
// a machine without a debugger still says where it happened. A line on stderr marks the
// end of the tests, so a crash after it is known to happen during exit (static
// destructors, atexit handlers, library teardown).
#include <execinfo.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};

void Write(const char* s) {
  const ssize_t r = write(STDERR_FILENO, s, std::strlen(s));
  (void)r;
}

void OnSignal(int sig, siginfo_t* info, void*) {
  char line[160];
  std::snprintf(line, sizeof line, "\n*** signal %d (%s), fault address %p; backtrace:\n", sig,
                strsignal(sig), info != nullptr ? info->si_addr : nullptr);
  Write(line);
  void* frames[128];
  const int n = backtrace(frames, 128);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
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
