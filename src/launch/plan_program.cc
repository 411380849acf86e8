// How a worker runs PROGRAM (torchrun's forms, docs/launcher.md "How PROGRAM runs"): directly, as a .py
// script or as -m MODULE under a Python interpreter; what the workers exec, resolved on this host; and
// each worker's argv.

#include <fmt/core.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>

#include "cohort/error.h"
#include "common/env.h"
#include "common/socket.h"
#include "launch/plan_internal.h"

namespace cohort::launch {
namespace {

// The Python interpreter of .py programs and -m modules (read from the launcher's environment map,
// like every setting build_plan uses, so that tests can give it).
const env::StringSetting kPython("COHORT_PYTHON", "python3",
                                 "interpreter that runs a .py PROGRAM and -m MODULE (cohort run --python overrides)");

}  // namespace

// torchrun's program forms: a PROGRAM ending in .py runs as `PYTHON -u PROGRAM ARGS` and -m MODULE as
// `PYTHON -u -m MODULE ARGS`; --no-python runs PROGRAM directly whatever its name. Other programs run
// directly as before (torchrun would hand them to Python too; cohort runs executables of any kind).
void set_program_form(Plan& p, const Options& o, const EnvMap& env) {
  const std::string& program = o.program[0];
  if (o.module && o.no_python)
    throw ConfigError("-m/--module and --no-python both given: -m runs PROGRAM as a Python module, --no-python runs "
                      "it directly; use one");
  if (o.python && o.no_python) throw ConfigError("--python and --no-python both given; use one");
  if (o.use_env && o.append_local_rank)
    throw ConfigError("--use-env and --append-local-rank both given: --use-env says the program reads LOCAL_RANK "
                      "from its environment, --append-local-rank passes --local_rank=N; use one");
  const bool script = !o.no_python && !o.module && program.size() > 3 && program.ends_with(".py");
  p.form.kind = o.module ? "module" : script ? "script" : "direct";
  p.form.append_local_rank = o.append_local_rank;
  if (o.local_rank_arg) {
    const std::string& given = *o.local_rank_arg;
    if (given != "local_rank" && given != "local-rank" && given != "auto")
      throw ConfigError(fmt::format("--local-rank-arg {}: expected local_rank (torch 1.x's launch), local-rank "
                                    "(torch 2.x's) or auto (as the installed torch's launch spells it)",
                                    given));
    if (!o.append_local_rank)
      throw ConfigError(fmt::format("--local-rank-arg {} without a local rank argument to spell: it goes with "
                                    "--append-local-rank (cohort launch passes one unless --use-env)",
                                    given));
    p.form.local_rank_arg = given == "local-rank" ? "--local-rank" : "--local_rank";
    p.form.local_rank_arg_source = given == "auto" ? "auto" : "--local-rank-arg";
  }
  if (p.form.kind == "direct") {
    if (o.python)
      throw ConfigError(fmt::format("--python {}: '{}' runs directly (it does not end in .py and -m is not given); "
                                    "name the interpreter as PROGRAM instead: cohort run ... {} {}",
                                    *o.python, program, *o.python, program));
    return;
  }
  auto from_env = env.find(kPython.name());
  if (o.python) {
    p.form.python = *o.python;
    p.form.python_source = "--python";
  } else if (from_env != env.end() && !from_env->second.empty()) {
    p.form.python = from_env->second;
    p.form.python_source = kPython.name();
  } else {
    p.form.python = "python3";
    p.form.python_source = "default";
  }
  if (p.form.python.empty()) throw ConfigError("--python: expected an interpreter (a name on PATH or a path)");
}

void resolve_worker_command(Plan& p, std::string (*resolve)(const std::string&)) {
  const std::string& program = p.program.at(0);
  if (p.ray.enabled && p.this_node >= 0) {
    try {
      p.ray.command_path = resolve(p.ray.command);
    } catch (const ConfigError& e) {
      throw ConfigError(fmt::format("{} (cohort run --ray starts each node's Ray with it: install Ray on every node, "
                                    "or name the executable with --ray-command)",
                                    e.what()));
    }
    // Only node 0 runs the driver (a fan-out head that runs no node checks it before anything starts).
    if (p.this_node > 0) {
      p.program_path = p.form.kind == "direct" ? program : p.form.python;
      return;
    }
  }
  if (p.form.kind == "direct") {
    p.program_path = resolve(program);
    return;
  }
  if (p.form.kind == "script") {
    // Python opens the script itself: no PATH lookup, a relative name means this folder (as torchrun).
    auto here = [] {
      std::error_code ec;
      auto cwd = std::filesystem::current_path(ec);
      return ec ? std::string("the current folder") : cwd.string();
    };
    struct stat st {};
    if (stat(program.c_str(), &st) != 0) {
      if (errno == ENOENT)
        throw ConfigError(program.front() == '/' ? fmt::format("{}: no such file", program)
                                                 : fmt::format("{}: no such file in {}", program, here()));
      throw ConfigError(net::errno_string(program, errno));
    }
    if (S_ISDIR(st.st_mode)) throw ConfigError(fmt::format("{}: is a folder, not a Python script", program));
    if (access(program.c_str(), R_OK) != 0) throw ConfigError(net::errno_string(program + ": cannot read it", errno));
  }
  try {
    p.program_path = resolve(p.form.python);
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("{} (needed to run {}{}; --python INTERP or COHORT_PYTHON names another)", e.what(),
                                  p.form.kind == "module" ? "-m " : "", program));
  }
}

std::vector<std::string> worker_argv(const Plan& p, int process) {
  std::vector<std::string> argv;
  if (p.form.kind == "direct") {
    argv.push_back(p.program.at(0));
  } else {
    // -u as torchrun: unbuffered output reaches the console and the log files as it is written.
    argv = {p.program_path, "-u"};
    if (p.form.kind == "module") argv.push_back("-m");
    argv.push_back(p.program.at(0));
  }
  // Where torch.distributed.launch put it: before the program's own arguments.
  if (p.form.append_local_rank)
    argv.push_back(fmt::format("{}={}", p.form.local_rank_arg, p.local_rank_of(process)));
  argv.insert(argv.end(), p.program.begin() + 1, p.program.end());
  return argv;
}

}  // namespace cohort::launch
