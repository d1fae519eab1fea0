#include "common/stop_signal.h"

#include <atomic>
#include <csignal>

namespace dflash {
namespace {

std::atomic<int> g_stop_signal{0};

extern "C" void on_stop_signal(int signal) { g_stop_signal.store(signal); }

}  // namespace

void install_stop_signals() {
  struct sigaction sa = {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
}

int stop_signal() { return g_stop_signal.load(); }
void clear_stop_request() { g_stop_signal.store(0); }
const char* stop_signal_name() {
  switch (stop_signal()) {
    case SIGINT:
      return "SIGINT";
    case SIGTERM:
      return "SIGTERM";
  }
  return "";
}
int stop_exit_code() { return 128 + stop_signal(); }

}  // namespace dflash
