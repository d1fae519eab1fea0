// common: SIGINT and SIGTERM as a request to stop. Long commands (training, generation) check
// it between steps, keep what they have done (a checkpoint, finished lines), say how to
// continue, and exit with 128 + the signal's number, as a shell reports a process that signal
// killed: a scheduler can tell a stopped run from a finished one.
#pragma once

namespace dflash {

// From now on SIGINT and SIGTERM set the request instead of ending the process.
void install_stop_signals();
// The signal that asked to stop (SIGINT or SIGTERM), 0 when none did.
int stop_signal();
void clear_stop_request();
// "SIGINT" or "SIGTERM" ("" when none).
const char* stop_signal_name();
// The exit status for a stop: 128 + stop_signal().
int stop_exit_code();

}  // namespace dflash
