// torchrun's program forms under the real `cohort run`: a PROGRAM ending in .py runs under a Python
// interpreter (python3 on PATH, --python, COHORT_PYTHON), -m MODULE as `python -u -m`, --no-python runs
// PROGRAM itself, and --append-local-rank passes torch.distributed.launch's --local_rank=N. Every mode
// is covered: local, per-node (two launchers) and the ssh fan-out (agents resolve on their own host).
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <regex>
#include <thread>

#include <gtest/gtest.h>

#include "support/cohort_run.h"
#include "support/test_support.h"

namespace cohort::test {
namespace {

// argv run with `dir` as its current folder.
std::vector<std::string> in_dir(const std::string& dir, std::vector<std::string> argv) {
  argv.insert(argv.begin(), {"/bin/sh", "-c", "cd \"$0\" && exec \"$@\"", dir});
  return argv;
}

std::string real_path(const std::string& path) {
  char buf[PATH_MAX];
  return realpath(path.c_str(), buf) ? std::string(buf) : path;
}

size_t lines_of(const std::string& text) { return static_cast<size_t>(std::count(text.begin(), text.end(), '\n')); }

// A worker that says how it was started: its argv, its rank, whether its output is unbuffered (-u),
// and its folder. PYTHONUNBUFFERED is cleared for the tests so that only -u can make it so. The line
// and its newline in one write: unbuffered, print() writes them apart, and the two ranks share the
// job's stdout, so a line could be split by the other rank's (seen once under ASan's slower start).
const char* kShowPy =
    "import os, sys\n"
    "sys.stdout.write('argv0=%s args=[%s] rank=%s local=%s unbuffered=%s cwd=%s main=%s\\n' % (\n"
    "      os.path.basename(sys.argv[0]), ' '.join(sys.argv[1:]), os.environ['RANK'], os.environ['LOCAL_RANK'],\n"
    "      sys.stdout.write_through, os.getcwd(), __name__))\n";
const std::vector<std::string> kPythonEnv = {"PYTHONUNBUFFERED="};

void write_executable(const std::string& path, const std::string& text) {
  write_file(path, text);
  chmod(path.c_str(), 0755);
}

TEST(ProgramForms, APyFileInTheCurrentFolderRunsUnderPython3) {
  TempDir dir;
  write_file(dir.file("ddp.py"), kShowPy);
  auto r = run_process(in_dir(dir.path(), cohort_run({"--nproc-per-node", "2", "--no-tag-output", "ddp.py", "--lr",
                                                      "0.1"})),
                       kPythonEnv, 60);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string cwd = real_path(dir.path());
  for (int rank = 0; rank < 2; ++rank)
    EXPECT_NE(r.out.find("argv0=ddp.py args=[--lr 0.1] rank=" + std::to_string(rank) + " local=" +
                         std::to_string(rank) + " unbuffered=True cwd=" + cwd + " main=__main__\n"),
              std::string::npos)
        << r.out;

  // A script that is not there: one line naming it and the folder looked in, before anything starts.
  auto missing = run_process(in_dir(dir.path(), cohort_run({"-n", "2", "missing.py"})), {}, 30);
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_EQ(missing.err, "cohort run: missing.py: no such file in " + cwd + "\n");
}

TEST(ProgramForms, ModuleFormRunsPythonDashM) {
  TempDir dir;
  write_file(dir.file("mymod.py"), kShowPy);
  auto r = run_process(in_dir(dir.path(), cohort_run({"-n", "2", "--no-tag-output", "-m", "mymod", "--epochs", "3"})),
                       kPythonEnv, 60);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("argv0=mymod.py args=[--epochs 3] rank=1 local=1 unbuffered=True"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("main=__main__"), std::string::npos) << r.out;
  // torchrun's long spelling, and a module Python cannot find fails in the worker, named in the summary.
  auto absent = run_process(in_dir(dir.path(), cohort_run({"--module", "no_such_module_here"})), kPythonEnv, 60);
  EXPECT_EQ(absent.exit_code, 1) << absent.err;
  EXPECT_NE(absent.err.find("No module named no_such_module_here"), std::string::npos) << absent.err;
}

TEST(ProgramForms, TheInterpreterComesFromPythonFlagThenCohortPythonThenPath) {
  TempDir dir;
  write_file(dir.file("ddp.py"), kShowPy);
  // A stand-in interpreter that only says how it was called.
  write_executable(dir.file("fakepy"), "#!/bin/sh\necho \"fakepy args=[$*]\"\n");
  auto flag = run_process(in_dir(dir.path(), cohort_run({"--python", dir.file("fakepy"), "ddp.py", "a"})), {}, 30);
  ASSERT_EQ(flag.exit_code, 0) << flag.err;
  EXPECT_EQ(flag.out, "fakepy args=[-u ddp.py a]\n");
  const char* path = getenv("PATH");
  auto setting = run_process(in_dir(dir.path(), cohort_run({"-m", "pkg.main", "b"})),
                             {"COHORT_PYTHON=fakepy", "PATH=" + dir.path() + ":" + (path ? path : "/usr/bin:/bin")}, 30);
  ASSERT_EQ(setting.exit_code, 0) << setting.err;
  EXPECT_EQ(setting.out, "fakepy args=[-u -m pkg.main b]\n");

  // No interpreter: one line saying which, what needed it, and how to name another.
  auto none = run_process(in_dir(dir.path(), cohort_run({"-n", "2", "ddp.py"})), {"PATH=/nonexistent-dir"}, 30);
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_EQ(none.err,
            "cohort run: program 'python3' not found on PATH (needed to run ddp.py; --python INTERP or COHORT_PYTHON "
            "names another)\n");
  // --python for a program that runs directly is a mistake worth saying.
  auto direct = run_process(in_dir(dir.path(), cohort_run({"--python", "python3", "/bin/true"})), {}, 30);
  EXPECT_EQ(direct.exit_code, 2);
  EXPECT_NE(direct.err.find("--python python3: '/bin/true' runs directly"), std::string::npos) << direct.err;
  EXPECT_EQ(lines_of(direct.err), 1u) << direct.err;
}

TEST(ProgramForms, NoPythonRunsTheProgramItselfWhateverItsName) {
  TempDir dir;
  write_executable(dir.file("tool.py"), "#!/bin/sh\necho \"sh ran tool.py with [$*]\"\n");
  auto r = run_process(in_dir(dir.path(), cohort_run({"--no-python", "./tool.py", "x", "y"})), {}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "sh ran tool.py with [x y]\n");
  // torchrun's underscore spelling; a bare name is looked up on PATH, as exec would, with a hint.
  auto bare = run_process(in_dir(dir.path(), cohort_run({"--no_python", "tool.py"})), {}, 30);
  EXPECT_EQ(bare.exit_code, 2);
  EXPECT_EQ(bare.err,
            "cohort run: program 'tool.py' not found on PATH (there is one in this folder: name it ./tool.py)\n");
  auto both = run_process(in_dir(dir.path(), cohort_run({"--no-python", "-m", "mod"})), {}, 30);
  EXPECT_EQ(both.exit_code, 2);
  EXPECT_NE(both.err.find("-m/--module and --no-python both given"), std::string::npos) << both.err;
  EXPECT_EQ(lines_of(both.err), 1u) << both.err;
}

TEST(ProgramForms, AppendLocalRankPassesTorchDistributedLaunchsArgument) {
  TempDir dir;
  write_file(dir.file("ddp.py"), kShowPy);
  auto r = run_process(in_dir(dir.path(), cohort_run({"-n", "2", "--no-tag-output", "--append-local-rank", "ddp.py",
                                                      "--lr", "1"})),
                       kPythonEnv, 60);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("args=[--local_rank=0 --lr 1] rank=0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("args=[--local_rank=1 --lr 1] rank=1"), std::string::npos) << r.out;
  // --use-env (the launcher's way to say "read LOCAL_RANK") is accepted, with a note, and appends nothing.
  auto env = run_process(in_dir(dir.path(), cohort_run({"--use_env", "--no-tag-output", "ddp.py"})), kPythonEnv, 60);
  ASSERT_EQ(env.exit_code, 0) << env.err;
  EXPECT_NE(env.out.find("args=[] rank=0"), std::string::npos) << env.out;
  EXPECT_EQ(env.err.find("cohort run: note: --use-env: every worker gets LOCAL_RANK"), 0u) << env.err;
  auto both = run_process(in_dir(dir.path(), cohort_run({"--use-env", "--append-local-rank", "ddp.py"})), {}, 30);
  EXPECT_EQ(both.exit_code, 2);
  EXPECT_NE(both.err.find("--use-env and --append-local-rank both given"), std::string::npos) << both.err;
}

TEST(ProgramForms, AMissingModuleNamesTheInterpreterThatRanAndHowToChooseAnother) {
  // A pyenv or venv shell whose python3 lacks torch (issue 46): the summary says which interpreter ran.
  // The stand-in interpreters fail as Python does; `bin/python3` comes first on PATH, as a shim does.
  TempDir dir;
  write_file(dir.file("ddp.py"), kShowPy);
  mkdir(dir.file("bin").c_str(), 0755);
  const std::string no_torch = "#!/bin/sh\necho 'Traceback (most recent call last):' >&2\n"
                               "echo \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n";
  write_executable(dir.file("bin/python3"), no_torch);
  const char* path = getenv("PATH");
  const std::string shim_path = "PATH=" + dir.file("bin") + ":" + (path ? path : "/usr/bin:/bin");
  auto r = run_process(in_dir(dir.path(), cohort_run({"-n", "1", "ddp.py"})), {shim_path}, 30);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("| ModuleNotFoundError: No module named 'torch'\n  the interpreter that ran was " +
                       dir.file("bin/python3") +
                       " (python3, the default, found on PATH): a module it cannot import may be installed for "
                       "another Python; --python PATH or COHORT_PYTHON=PATH chooses that one"),
            std::string::npos)
      << r.err;
  auto flag = run_process(in_dir(dir.path(), cohort_run({"--python", dir.file("bin/python3"), "-m", "train"})), {}, 30);
  EXPECT_EQ(flag.exit_code, 1) << flag.err;
  EXPECT_NE(flag.err.find("the interpreter that ran was " + dir.file("bin/python3") + " (" + dir.file("bin/python3") +
                          ", from --python): "),
            std::string::npos)
      << flag.err;
  // Any other failure of a script is not about the interpreter: no such line.
  write_executable(dir.file("other"), "#!/bin/sh\necho 'ValueError: bad learning rate' >&2\nexit 1\n");
  auto other = run_process(in_dir(dir.path(), cohort_run({"ddp.py"})), {"COHORT_PYTHON=" + dir.file("other")}, 30);
  EXPECT_EQ(other.exit_code, 1) << other.err;
  EXPECT_NE(other.err.find("| ValueError: bad learning rate"), std::string::npos) << other.err;
  EXPECT_EQ(other.err.find("the interpreter that ran"), std::string::npos) << other.err;
}

// `cohort launch ARGS` runs under cohort run's rules with torch.distributed.launch's argument.
std::vector<std::string> cohort_launch(std::vector<std::string> args) {
  args.insert(args.begin(), {cohort_tool(), "launch"});
  return args;
}

// A folder for PYTHONPATH that holds only torch/version.py of the given version: what the launcher
// reads to spell the argument (it does not import torch).
std::string fake_torch(const TempDir& dir, const std::string& name, const std::string& version) {
  mkdir(dir.file(name).c_str(), 0755);
  mkdir(dir.file(name + "/torch").c_str(), 0755);
  write_file(dir.file(name + "/torch/version.py"), "__version__ = '" + version + "'\ndebug = False\n");
  return dir.file(name);
}

TEST(ProgramForms, LaunchIsTorchDistributedLaunchsLineWithTheInstalledTorchsSpelling) {
  TempDir dir;
  write_file(dir.file("ddp.py"), kShowPy);
  // torch 2.x's launch passes --local-rank=N, before the script's own arguments.
  const std::string torch2 = "PYTHONPATH=" + fake_torch(dir, "torch2", "2.6.0+cpu");
  auto two = run_process(in_dir(dir.path(), cohort_launch({"--nproc_per_node", "2", "--no-tag-output", "ddp.py",
                                                           "--lr", "1"})),
                         {"PYTHONUNBUFFERED=", "OMP_NUM_THREADS=1", torch2}, 60);
  ASSERT_EQ(two.exit_code, 0) << two.err;
  EXPECT_NE(two.out.find("args=[--local-rank=0 --lr 1] rank=0"), std::string::npos) << two.out;
  EXPECT_NE(two.out.find("args=[--local-rank=1 --lr 1] rank=1"), std::string::npos) << two.out;
  EXPECT_EQ(two.err, "");
  // torch 1.13's passes --local_rank=N.
  const std::string torch1 = "PYTHONPATH=" + fake_torch(dir, "torch1", "1.13.0a0");
  auto one = run_process(in_dir(dir.path(), cohort_launch({"--nproc_per_node=1", "ddp.py"})),
                         {"PYTHONUNBUFFERED=", torch1}, 60);
  ASSERT_EQ(one.exit_code, 0) << one.err;
  EXPECT_NE(one.out.find("args=[--local_rank=0] rank=0"), std::string::npos) << one.out;
  // --dry-run says which spelling and why.
  auto dry = run_process(in_dir(dir.path(), cohort_launch({"--dry-run", "--nproc_per_node", "2", "ddp.py"})), {torch2},
                         30);
  ASSERT_EQ(dry.exit_code, 0) << dry.err;
  EXPECT_TRUE(std::regex_search(dry.out, std::regex(R"(arguments       --local-rank=<local rank> before the program's own )"
                                                    R"(\(--append-local-rank; spelling: auto: torch 2\.6\.0\+cpu of /\S+\))")))
      << dry.out;
  // --use_env: the program reads LOCAL_RANK; nothing is passed (and nothing to note).
  auto env = run_process(in_dir(dir.path(), cohort_launch({"--use_env", "ddp.py", "--x"})), {"PYTHONUNBUFFERED=", torch2},
                         60);
  ASSERT_EQ(env.exit_code, 0) << env.err;
  EXPECT_NE(env.out.find("args=[--x] rank=0"), std::string::npos) << env.out;
  EXPECT_EQ(env.err, "");
  // The spelling by flag, whatever torch is installed (here none: no PYTHONPATH stub).
  auto flag = run_process(in_dir(dir.path(), cohort_launch({"--local-rank-arg", "local-rank", "ddp.py"})),
                          {"PYTHONUNBUFFERED="}, 60);
  ASSERT_EQ(flag.exit_code, 0) << flag.err;
  EXPECT_NE(flag.out.find("args=[--local-rank=0] rank=0"), std::string::npos) << flag.out;
  // As torch.distributed.launch: --no_python needs --use_env (a program run directly gets no argument).
  auto direct = run_process(in_dir(dir.path(), cohort_launch({"--no_python", "/bin/true"})), {}, 30);
  EXPECT_EQ(direct.exit_code, 2);
  EXPECT_EQ(direct.err, "cohort launch: --no-python without --use-env: a program run directly gets no --local_rank "
                        "argument (torch.distributed.launch refuses this too); add --use-env and read LOCAL_RANK\n");
  auto bad = run_process(cohort_run({"--append-local-rank", "--local-rank-arg", "localrank", "x.py"}), {}, 30);
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_EQ(lines_of(bad.err), 1u) << bad.err;
  EXPECT_NE(bad.err.find("--local-rank-arg localrank: expected local_rank"), std::string::npos) << bad.err;
}

TEST(ProgramForms, DryRunShowsTheCommandOfEveryWorker) {
  TempDir dir;
  write_file(dir.file("ddp.py"), kShowPy);
  auto r = run_process(in_dir(dir.path(), cohort_run({"--dry-run", "-n", "2", "--append-local-rank", "ddp.py", "--name",
                                                      "two words"})),
                       {}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(std::regex_search(r.out, std::regex(R"(program         ddp.py --name two words \(a .py script: run by python3 \[default\], here /\S+\))")))
      << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex(R"(\n    command: /\S+ -u ddp.py --local_rank=0 --name 'two words'\n)")))
      << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex(R"(\n    command: /\S+ -u ddp.py --local_rank=1 --name 'two words'\n)")))
      << r.out;
}

TEST(ProgramForms, PerNodeLaunchersEachRunTheScriptFromTheirFolder) {
  TempDir dir;
  write_file(dir.file("ddp.py"), kShowPy);
  int port = free_port();
  auto node = [&](int rank) {
    return run_process(in_dir(dir.path(), cohort_run({"--nnodes", "2", "--node-rank", std::to_string(rank),
                                                      "--master-addr", "127.0.0.1", "--master-port",
                                                      std::to_string(port), "--nproc-per-node", "1", "--join-timeout",
                                                      "20", "ddp.py", "--node", std::to_string(rank)})),
                       kPythonEnv, 60);
  };
  ProcessResult second;
  std::thread t([&] { second = node(1); });
  auto first = node(0);
  t.join();
  ASSERT_EQ(first.exit_code, 0) << first.err;
  ASSERT_EQ(second.exit_code, 0) << second.err;
  EXPECT_NE(first.out.find("argv0=ddp.py args=[--node 0] rank=0 local=0 unbuffered=True"), std::string::npos) << first.out;
  EXPECT_NE(second.out.find("argv0=ddp.py args=[--node 1] rank=1 local=0 unbuffered=True"), std::string::npos)
      << second.out;
}

TEST(ProgramForms, FanOutAgentsRunTheScriptInTheHeadsFolderWithTheirOwnPython) {
  TempDir dir;
  write_file(dir.file("ddp.py"), kShowPy);
  // The ssh stand-in lands in / (as ssh lands in the home folder); on hostB its PATH finds another
  // python3 first, which only says so: each agent resolves the interpreter on its own host.
  std::string other = dir.file("hostB-bin");
  mkdir(other.c_str(), 0755);
  write_executable(other + "/python3", "#!/bin/sh\necho \"hostB's python3 got [$*] in $(pwd)\"\n");
  write_executable(dir.file("fake-ssh"),
                   "#!/bin/sh\n"
                   "while [ \"${1#-}\" != \"$1\" ]; do if [ \"$1\" = -o ]; then shift; fi; shift; done\n"
                   "host=$1; shift\n"
                   "cd /\n"
                   "if [ \"$host\" = hostB ]; then PATH=" + other + ":$PATH; export PATH; fi\n"
                   "COHORT_HOST_ID=$host exec \"$@\"\n");
  auto r = run_process(in_dir(dir.path(), cohort_run({"-H", "hostA:1,hostB:1", "--master-addr", "127.0.0.1",
                                                      "--ssh-command", dir.file("fake-ssh"), "ddp.py", "--x"})),
                       kPythonEnv, 60);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string cwd = real_path(dir.path());
  EXPECT_NE(r.out.find("[hostA:0] argv0=ddp.py args=[--x] rank=0 local=0 unbuffered=True cwd=" + cwd), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("[hostB:1] hostB's python3 got [-u ddp.py --x] in " + cwd + "\n"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace cohort::test
