// dist: the local launcher behind `dflash --nproc-per-node N`: one process per rank on this
// machine with torchrun's variables, stopped together when one fails.
#pragma once
#include <optional>
#include <string>
#include <vector>

namespace dflash::dist {

// Finds `--nproc-per-node N` or `--nproc-per-node=N` in argv (before any `--`), removes it and
// returns N; nullopt when absent. A missing or non-positive N throws dflash::Error.
std::optional<int> take_nproc_option(std::vector<std::string>& argv);

// A TCP port on 127.0.0.1 that nobody is bound to now (the kernel's choice), for a rendezvous.
int free_port();

// Runs `program` (this executable by default) nproc times with `argv` (argv[0] included) and
// RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT (kept from
// the environment if set, else a free port) and DFLASH_LAUNCHED=1 added to this environment.
// Children share this process's stdout and stderr. SIGINT and SIGTERM are forwarded to them.
// When one exits non-zero or by a signal, the others get SIGTERM and, after DFLASH_KILL_GRACE_S
// seconds (default 30), SIGKILL; `continue_hint` (if any), how to go on from there, follows the
// line naming the failed rank. Ranks that exit with 128 + a signal this launcher forwarded
// stopped as asked: no failure is reported. Returns 0 when all exited 0, else the first
// non-zero exit code (128 + signal number for a signal).
int launch_local(int nproc, const std::vector<std::string>& argv,
                 const std::string& program = "/proc/self/exe",
                 const std::string& continue_hint = "");

}  // namespace dflash::dist
