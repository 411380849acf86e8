// horovodrun's line under cohort (`horovodrun`, the tool under that name, and `cohort horovodrun`): its flags
// become cohort run's plan (checked in --dry-run), and real workers, here and on a host started over the
// ssh line that -p and -i extend, see Horovod's variables as `horovodrun --gloo` sets them. The bad lines
// are refused with one line naming the flag.
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "support/test_support.h"

namespace cohort::test {
namespace {

// The tool under Horovod's launcher's name: the link the build puts beside it.
std::string horovodrun() { return cohort_tool().substr(0, cohort_tool().rfind('/')) + "/horovodrun"; }

std::vector<std::string> line(std::vector<std::string> args) {
  args.insert(args.begin(), horovodrun());
  return args;
}

bool has(const std::string& text, const std::string& what) { return text.find(what) != std::string::npos; }

// An ssh stand-in: "fake-ssh [-o X] [-p PORT] [-i FILE] HOST COMMAND..." records its options in
// dir/ssh-options and runs COMMAND here as if on HOST, in an environment as bare as an ssh session's.
std::string write_ssh_shim(const TempDir& dir) {
  std::string path = dir.file("fake-ssh");
  write_file(path,
             "#!/bin/sh\n"
             "opts=\"\"\n"
             "while [ \"${1#-}\" != \"$1\" ]; do\n"
             "  case $1 in -o|-p|-i) opts=\"$opts $1 $2\"; shift 2 ;; *) opts=\"$opts $1\"; shift ;; esac\n"
             "done\n"
             "echo \"$opts\" > " + dir.file("ssh-options") + "\n"
             "host=$1; shift\n"
             "exec env -i PATH=\"$PATH\" HOME=\"$HOME\" COHORT_HOST_ID=$host \"$@\"\n");
  chmod(path.c_str(), 0755);
  return path;
}

const char* kPrintHorovodEnv =
    "echo \"hvd rank=$HOROVOD_RANK size=$HOROVOD_SIZE local=$HOROVOD_LOCAL_RANK/$HOROVOD_LOCAL_SIZE "
    "cross=$HOROVOD_CROSS_RANK/$HOROVOD_CROSS_SIZE host=$HOROVOD_HOSTNAME cohort_rank=$RANK setting=$HVD_SETTING\"";

TEST(Horovodrun, FlagsBecomeCohortRunsPlan) {
  TempDir dir;
  auto r = run_process(line({"-np", "3", "-H", "localhost:2,hostB:2", "-p", "2222", "-i", "/keys/id_hvd",
                             "--network-interface", "lo", "--start-timeout", "40", "--gloo", "--verbose",
                             "--output-filename", dir.file("out"), "--timeline-filename", dir.file("tl.json"),
                             "--dry-run", "python3", "train.py", "--epochs", "1"}),
                       {}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string& plan = r.out;
  EXPECT_TRUE(has(plan, "mode            fan-out")) << plan;
  EXPECT_TRUE(has(plan, "nodes           2  [-H localhost:2,hostB:2]")) << plan;
  EXPECT_TRUE(has(plan, "world size      3  [-n]")) << plan;  // -np: the first 3 slots
  EXPECT_TRUE(has(plan, "node 1 (hostB, over ssh): ranks 2-2")) << plan;
  // -p and -i extend the ssh line; --start-timeout is how long the nodes may take to meet.
  EXPECT_TRUE(has(plan, "started by `ssh -o BatchMode=yes -p 2222 -i /keys/id_hvd HOST`, the nodes meet within 40 s"))
      << plan;
  // --network-interface: the store's address and the ranks' TCP interfaces.
  EXPECT_TRUE(has(plan, "[address: -mca oob_tcp_if_include lo;")) << plan;
  EXPECT_TRUE(has(plan, "COHORT_TCP_IFNAME=lo")) << plan;
  EXPECT_TRUE(has(plan, "COHORT_LOG_LEVEL=info")) << plan;  // --verbose
  EXPECT_TRUE(has(plan, "files under " + dir.file("out") + "/rank.N/")) << plan;
  EXPECT_TRUE(has(plan, "timeline        " + dir.file("tl.json"))) << plan;
  EXPECT_TRUE(has(plan, "command: python3 train.py --epochs 1")) << plan;
  // Horovod's variables: local rank 1 exists on the first host only, so its cross size is 1.
  EXPECT_TRUE(has(plan, "HOROVOD_RANK=0 HOROVOD_SIZE=3 HOROVOD_LOCAL_RANK=0 HOROVOD_LOCAL_SIZE=2 HOROVOD_CROSS_RANK=0 "
                        "HOROVOD_CROSS_SIZE=2 HOROVOD_HOSTNAME=localhost"))
      << plan;
  EXPECT_TRUE(has(plan, "HOROVOD_RANK=1 HOROVOD_SIZE=3 HOROVOD_LOCAL_RANK=1 HOROVOD_LOCAL_SIZE=2 HOROVOD_CROSS_RANK=0 "
                        "HOROVOD_CROSS_SIZE=1 HOROVOD_HOSTNAME=localhost"))
      << plan;
  EXPECT_TRUE(has(r.err, "cohort horovodrun: note: --gloo: accepted")) << r.err;

  // The hostfile form, and `cohort horovodrun` is the same command.
  write_file(dir.file("hosts"), "localhost slots=2\nhostB slots=1\n");
  auto hf = run_process({cohort_tool(), "horovodrun", "-np", "3", "--hostfile", dir.file("hosts"), "--dry-run", "true"},
                        {}, 30);
  ASSERT_EQ(hf.exit_code, 0) << hf.err;
  EXPECT_TRUE(has(hf.out, "node 1 (hostB, over ssh): ranks 2-2")) << hf.out;

  // Without -H: -np processes here, as horovodrun runs them on localhost.
  auto local = run_process(line({"-np", "2", "--dry-run", "true"}), {}, 30);
  ASSERT_EQ(local.exit_code, 0) << local.err;
  EXPECT_TRUE(has(local.out, "mode            local")) << local.out;
  EXPECT_TRUE(has(local.out, "HOROVOD_RANK=1 HOROVOD_SIZE=2 HOROVOD_LOCAL_RANK=1 HOROVOD_LOCAL_SIZE=2 "
                             "HOROVOD_CROSS_RANK=0 HOROVOD_CROSS_SIZE=1"))
      << local.out;
  // cohort run itself does not set them.
  auto run = run_process({cohort_tool(), "run", "-n", "2", "--dry-run", "true"}, {}, 30);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_FALSE(has(run.out, "HOROVOD_")) << run.out;
}

TEST(Horovodrun, WorkersHereAndOverSshSeeHorovodsVariables) {
  TempDir dir;
  std::string shim = write_ssh_shim(dir);
  // Two hosts, uneven: localhost runs ranks 0-1, hostB (started through the shim) rank 2.
  auto r = run_process(line({"-np", "3", "-H", "localhost:2,hostB:1", "--network-interface", "lo", "--ssh-command",
                             shim, "-p", "2222", "-i", "/keys/id_hvd", "/bin/sh", "-c", kPrintHorovodEnv}),
                       {"HVD_SETTING=from-the-launcher", "RANK=7"}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(has(r.out, "[localhost:0] hvd rank=0 size=3 local=0/2 cross=0/2 host=localhost cohort_rank=0 setting=from-the-launcher\n")) << r.out;
  EXPECT_TRUE(has(r.out, "[localhost:1] hvd rank=1 size=3 local=1/2 cross=0/1 host=localhost cohort_rank=1 setting=from-the-launcher\n")) << r.out;
  EXPECT_TRUE(has(r.out, "[hostB:2] hvd rank=2 size=3 local=0/1 cross=1/2 host=hostB cohort_rank=2 setting=from-the-launcher\n"))
      << "the launcher's environment reaches the other host, as horovodrun forwards it (not its RANK): " << r.out;
  // -p and -i are added to the --ssh-command line.
  EXPECT_EQ(read_file(dir.file("ssh-options")), " -p 2222 -i /keys/id_hvd\n");
}

TEST(Horovodrun, BadLinesAreRefusedWithOneLine) {
  auto refused = [](const std::vector<std::string>& args, const std::string& what) {
    auto r = run_process(line(args), {}, 30);
    EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
    EXPECT_TRUE(has(r.err, what)) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  };
  refused({"python3", "train.py"}, "cohort horovodrun: -np N is required (the number of processes), as with horovodrun");
  refused({"-np", "2", "--min-np", "1", "--max-np", "4", "python3", "train.py"},
          "cohort horovodrun: --min-np: an elastic job needs --host-discovery-script SCRIPT (or a fixed -H list)");
  refused({"-np", "5", "--min-np", "1", "--max-np", "4", "--host-discovery-script", "./d.sh", "python3", "train.py"},
          "cohort horovodrun: -np 5 is outside --min-np 1 .. --max-np 4");
  refused({"-np", "2", "--fusion-threshold-mb", "32", "python3", "train.py"}, "unknown flag --fusion-threshold-mb");
  refused({"-np", "2", "--output-filenam", "o", "python3", "train.py"},
          "unknown flag --output-filenam (did you mean --output-filename?)");
  refused({"-np", "2", "-p", "ssh", "-H", "a:1,b:1", "true"}, "cohort horovodrun: -p ssh: expected a port between 1 and 65535");
  refused({"-np", "2", "-p", "123456789012345678901", "-H", "a:1,b:1", "true"},
          "cohort horovodrun: -p 123456789012345678901: expected a port between 1 and 65535");
  refused({"-np", "4", "-H", "localhost:2", "--dry-run", "true"}, "cohort horovodrun: ");  // more than the slots
}

// Horovod's rule for the elastic driver's discovery script: a script that fails on its first run (an exit
// code, a hang past COHORT_HOROVOD_DISCOVERY_TIMEOUT, a line that is not host:slots) is a mistake in the
// line: horovodrun stops at once with one line naming the script and why, and starts nothing.
TEST(Horovodrun, ElasticDiscoveryScriptThatFailsStopsTheJobWithOneLine) {
  TempDir dir;
  auto script = [&](const std::string& name, const std::string& body) {
    std::string path = dir.file(name);
    write_file(path, "#!/bin/sh\n" + body);
    chmod(path.c_str(), 0755);
    return path;
  };
  auto fails = [&](const std::string& path, const std::vector<std::string>& env, const std::string& what) {
    auto r = run_process(line({"-np", "1", "--min-np", "1", "--max-np", "2", "--host-discovery-script", path,
                               "/bin/sh", "-c", "touch " + dir.file("started")}),
                         env, 30);
    EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
    EXPECT_TRUE(has(r.err, "cohort horovodrun: host discovery script " + path + ": " + what)) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(access(dir.file("started").c_str(), F_OK), 0) << "a worker ran: " << r.out << r.err;
    return r.seconds;
  };
  fails(script("exits.sh", "echo 'no hosts today' >&2\nexit 3\n"), {}, "exited with code 3: no hosts today\n");
  fails(script("bad-line.sh", "echo localhost:1\necho 'localhost:x'\n"), {},
        "its line 2 'localhost:x': expected host:slots with slots a whole number of at least 1\n");
  auto took = fails(script("hangs.sh", "echo localhost:1\nsleep 60\n"), {"COHORT_HOROVOD_DISCOVERY_TIMEOUT=1"},
                    "did not finish within 1 s (COHORT_HOROVOD_DISCOVERY_TIMEOUT); killed\n");
  EXPECT_LT(took, 20) << "the hanging script was not killed at its deadline";
}

}  // namespace
}  // namespace cohort::test
