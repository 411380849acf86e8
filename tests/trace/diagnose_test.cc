// The flight recorder's ring, the diagnosis read from several rings, dumps and the timeline merge:
// unit tests with rings written by hand the way the communicator writes them.
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include <fmt/core.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cohort/error.h"
#include "cohort/types.h"
#include "launch/inspector.h"
#include "support/test_support.h"
#include "trace/diagnose.h"
#include "trace/dump.h"
#include "trace/recorder.h"
#include "trace/timeline.h"

namespace cohort::trace {
namespace {

using coll::OpKind;
constexpr uint32_t kWorld = 0xabcd1234;
constexpr int64_t kSecond = 1000000000;

OpBegin allreduce(uint64_t seq, uint64_t count, int64_t t_start) {
  return OpBegin{kWorld, seq, OpKind::kAllreduce, uint8_t(DataType::kFloat32), uint8_t(ReduceOp::kSum), -1, count,
                 count * 4, 0, t_start};
}

// `world` rings; rank r runs allreduces 1..done[r] to completion, then starts running[r] (0: none).
struct Job {
  std::vector<Ring> rings;
  Job(const std::vector<uint32_t>& done, const std::vector<uint32_t>& running, int64_t t0 = kSecond) {
    int world = int(done.size());
    for (int r = 0; r < world; ++r) {
      rings.push_back(Ring::create(16, r, world, "host" + std::to_string(r), false));
      for (uint32_t s = 1; s <= done[r]; ++s) {
        auto op = allreduce(s, 1024, t0 + s * 1000);
        ring_finish(rings[r].header(), ring_append(rings[r].header(), op), op, true, 0);
      }
      if (running[r]) ring_append(rings[r].header(), allreduce(running[r], 1024, t0 + running[r] * 1000));
    }
  }
  std::vector<RankSnapshot> snapshots(int64_t taken_at) const {
    std::vector<RankSnapshot> out;
    for (const auto& r : rings) {
      auto s = r.snapshot();
      s.taken_at = taken_at;
      s.process_state = "running";
      out.push_back(s);
    }
    return out;
  }
};

TEST(FlightRing, KeepsTheLastEntriesInOrderAndCountsThem) {
  Ring ring = Ring::create(4, 3, 8, "node-a", false);
  for (uint32_t s = 1; s <= 10; ++s) {
    auto op = allreduce(s, 8, s);
    ring_finish(ring.header(), ring_append(ring.header(), op), op, true, 0);
  }
  auto snap = ring.snapshot();
  EXPECT_EQ(snap.rank, 3);
  EXPECT_EQ(snap.world, 8);
  EXPECT_EQ(snap.host, "node-a");
  EXPECT_EQ(snap.total, 10u);
  ASSERT_EQ(snap.entries.size(), 4u);
  EXPECT_EQ(snap.entries.front().seq, 7u);
  EXPECT_EQ(snap.entries.back().seq, 10u);
  EXPECT_EQ(snap.counters.ops, 10u);
  EXPECT_EQ(snap.counters.bytes, 10u * 32);
  EXPECT_EQ(describe(snap.entries.back()), "#10 allreduce(count=8, float, sum) (32 B)");
}

TEST(FlightRing, AWorkerAdoptsTheLaunchersRingAndRefusesAnythingElse) {
  // What the worker side sees: the launcher's ring through an inherited descriptor.
  Ring made = Ring::create(8, 1, 2, "h", false);
  Ring adopted = Ring::adopt(dup(made.fd()));
  auto op = allreduce(1, 8, 1);
  ring_finish(adopted.header(), ring_append(adopted.header(), op), op, true, 0);
  EXPECT_EQ(made.snapshot().total, 1u);
  // A descriptor that is something else (a child that inherited only the variable) is refused, and
  // left open: it belongs to someone else.
  test::TempDir dir;
  test::write_file(dir.file("other"), std::string(4096, 'x'));
  int fd = ::open(dir.file("other").c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  EXPECT_THROW(Ring::adopt(fd), ConfigError);
  EXPECT_GE(fcntl(fd, F_GETFD), 0);
  ::close(fd);
}

TEST(FlightRing, AFinishAfterTheRingWentRoundLeavesTheNewerEntry) {
  Ring ring = Ring::create(2, 0, 1, "h", false);
  auto first = allreduce(1, 8, 1);
  auto old = ring_append(ring.header(), first);
  for (uint32_t s = 2; s <= 3; ++s) ring_append(ring.header(), allreduce(s, 8, s));
  ring_finish(ring.header(), old, first, true, 0);
  for (const auto& e : ring.snapshot().entries) EXPECT_EQ(e.state, OpState::kRunning) << describe(e);
  EXPECT_EQ(ring.header().counters.ops.load(), 1u);  // still counted
}

TEST(FlightRing, ConcurrentWritersAndAReaderNeverSeeATornEntry) {
  Ring ring = Ring::create(64, 0, 1, "h", false);
  std::atomic<bool> stop{false};
  std::vector<std::thread> writers;
  for (uint32_t w = 0; w < 2; ++w)
    writers.emplace_back([&, w] {
      for (uint32_t s = 1; s <= 20000; ++s) {
        OpBegin op = allreduce(s, s, s);
        op.comm = w;  // count == seq in every entry: a torn copy breaks it
        ring_finish(ring.header(), ring_append(ring.header(), op), op, true, 0);
      }
    });
  std::thread reader([&] {
    while (!stop.load())
      for (const auto& e : ring.snapshot().entries) ASSERT_EQ(e.count, e.seq);
  });
  for (auto& t : writers) t.join();
  stop = true;
  reader.join();
  // The counters may lose a count to a concurrent finish (by design), never gain one.
  EXPECT_LE(ring.header().counters.ops.load(), 40000u);
  EXPECT_GT(ring.header().counters.ops.load(), 20000u);
}

// Two writers of one slot: a ring of 1 entry and 3 threads appending and finishing, so every append
// goes onto an operation that another thread may still be appending or finishing, while a reader copies
// the ring. Every field of an entry is derived from its number, so a copy mixing two writes shows. A
// slot whose version two writers got out of step stays odd (hidden from readers) until it is written
// again: once the writers stop, the slot must hold the last operation written there, finished. Several
// rounds, each a fresh ring: the threads of one round may overlap only part of the time.
TEST(FlightRing, WritersWrappingOntoSlotsInUseNeverTearAnEntryNorHideASlot) {
#if defined(COHORT_TEST_UNDER_TSAN)
  constexpr uint32_t kOps = 40000;  // TSan makes each atomic access ~20x slower
#else
  constexpr uint32_t kOps = 400000;
#endif
  constexpr uint32_t kSlots = 1, kWriters = 3, kRounds = 6;
  // The numbers fit in 32 bits, so the same test runs against ring layouts of either width.
  auto entry_of = [](uint32_t writer, uint32_t k) {
    OpBegin op = allreduce((uint64_t(writer + 1) << 24) | k, 0, 0);
    op.comm = writer;
    op.peer = int32_t(k);
    op.count = op.seq * 7;
    op.bytes = op.seq * 3;
    op.t_queued = int64_t(op.seq) + 11;
    op.t_start = int64_t(op.seq);
    return op;
  };
  auto torn = [](const OpRecord& e) {
    uint64_t k = e.seq & 0xffffff;
    bool ok = e.comm == (e.seq >> 24) - 1 && e.peer == int32_t(k) && e.count == e.seq * 7 && e.bytes == e.seq * 3 &&
              e.t_queued == int64_t(e.seq) + 11 && e.t_start == int64_t(e.seq) && e.kind == OpKind::kAllreduce &&
              ((e.state == OpState::kRunning && e.t_end == 0) ||
               (e.state == OpState::kDone && e.t_end == int64_t(e.seq) + 5));
    return !ok;
  };
  for (uint32_t round = 0; round < kRounds; ++round) {
    SCOPED_TRACE(fmt::format("round {}", round));
    Ring ring = Ring::create(kSlots, 0, 1, "h", false);
    std::atomic<uint32_t> ready{0}, writing{kWriters};
    std::vector<std::thread> writers;
    for (uint32_t w = 0; w < kWriters; ++w)
      writers.emplace_back([&, w] {
        ready.fetch_add(1);
        while (ready.load() <= kWriters) std::this_thread::yield();  // every writer and the reader
        for (uint32_t k = 1; k <= kOps; ++k) {
          OpBegin op = entry_of(w, k);
          ring_finish(ring.header(), ring_append(ring.header(), op), op, true, op.t_start + 5);
        }
        writing.fetch_sub(1);
      });
    uint64_t copies = 0, torn_copies = 0;
    std::string example;
    ready.fetch_add(1);
    while (writing.load() > 0) {
      for (const auto& e : ring.snapshot().entries) {
        ++copies;
        if (torn(e) && torn_copies++ == 0)
          example = fmt::format("{} {} t_end {} comm {} peer {}", describe(e), op_state_name(e.state), e.t_end, e.comm,
                                e.peer);
      }
    }
    for (auto& t : writers) t.join();
    EXPECT_EQ(torn_copies, 0u) << "of " << copies << " copies; the first: " << example;
    // Quiet now: every slot is readable and holds the last operation appended there, finished.
    auto last = ring.snapshot();
    EXPECT_EQ(last.total, uint64_t(kWriters) * kOps);
    ASSERT_EQ(last.entries.size(), kSlots) << "a slot was left hidden (odd version)";
    for (size_t i = 0; i < kSlots; ++i) {
      EXPECT_EQ(last.entries[i].index, last.total - kSlots + i);
      EXPECT_EQ(last.entries[i].state, OpState::kDone) << describe(last.entries[i]);
      EXPECT_FALSE(torn(last.entries[i])) << describe(last.entries[i]);
    }
  }
}

// The operation's number is 64-bit in the ring, the dumps, the diagnosis and the timeline: 32 bits run
// out within hours of small operations.
TEST(FlightRing, SequenceNumbersPast32BitsKeepEveryBit) {
  constexpr uint64_t kBig = (uint64_t(1) << 32) + 7;
  Job job({0, 0}, {0, 0});
  for (int r = 0; r < 2; ++r) {
    auto op = allreduce(kBig, 1024, kSecond);
    ring_finish(job.rings[r].header(), ring_append(job.rings[r].header(), op), op, true, 0);
  }
  ring_append(job.rings[0].header(), allreduce(kBig + 1, 1024, 2 * kSecond));
  auto snaps = job.snapshots(5 * kSecond);
  ASSERT_EQ(snaps[0].entries.size(), 2u);
  EXPECT_EQ(snaps[0].entries.back().seq, kBig + 1);
  EXPECT_EQ(describe(snaps[0].entries.back()), "#4294967304 allreduce(count=1024, float, sum) (4.0 KiB)");
  auto st = find_stall(snaps, 5 * kSecond, 1.0);
  ASSERT_TRUE(st);
  EXPECT_EQ(st->op.seq, kBig + 1);
  auto lines = diagnose(snaps);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("rank 1 stopped first, at #4294967303 "), std::string::npos) << lines[0];
  // A dump keeps the number; a dump of format 1 (32-bit numbers) still reads.
  auto back = snapshot_from_json(to_json(snaps[0]));
  EXPECT_EQ(back.entries.back().seq, kBig + 1);
  auto v1 = to_json(snaps[1]);
  v1["format"] = "cohort flight recorder 1";
  v1["ops"][0]["seq"] = 9;
  EXPECT_EQ(snapshot_from_json(v1).entries[0].seq, 9u);
  v1["format"] = "cohort flight recorder 7";
  try {
    snapshot_from_json(v1);
    FAIL() << "format 7 was read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("a flight recorder dump of another cohort version"), std::string::npos)
        << e.what();
  }
  // The timeline's records too.
  test::TempDir dir;
  TimelineWriter w(dir.file("rank0.timeline"));
  w.set_identity(0, 1, "h");
  OpRecord op = snaps[0].entries.front();
  op.t_end = op.t_start + 1000;
  w.add_op(op, 3, kBig + 2);
  w.flush();
  std::stringstream text;
  merge_timelines({dir.file("rank0.timeline")}, text);
  auto trace = nlohmann::json::parse(text.str());
  bool seen = false;
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "X") {
      seen = true;
      EXPECT_EQ(e["args"]["seq"].get<uint64_t>(), kBig);
      EXPECT_EQ(e["args"]["last_seq"].get<uint64_t>(), kBig + 2);
    }
  EXPECT_TRUE(seen) << text.str();
}

// A worker whose cohort library writes another ring layout than the launcher's says so, and records in
// its own memory rather than misread the launcher's ring. Likewise a timeline file of another version.
TEST(FlightRing, AnotherLayoutIsNamedAsSuch) {
  Ring made = Ring::create(8, 1, 2, "h", false);
  made.header().magic[7] = '1';  // what a launcher of layout 1 writes
  try {
    Ring::adopt(dup(made.fd()));
    FAIL() << "a ring of layout 1 was adopted";
  } catch (const RingLayoutError& e) {
    EXPECT_NE(std::string(e.what()).find("ring has layout 1, this program's cohort library writes layout 2"),
              std::string::npos)
        << e.what();
  }
  Recorder::Settings settings;
  settings.ring_fd = dup(made.fd());
  Recorder recorder(settings);
  auto op = allreduce(1, 8, 1);
  OpRun run;
  recorder.op_end(recorder.op_begin(op), op, true, run);
  EXPECT_EQ(made.snapshot().total, 0u);        // the launcher's ring is left alone
  EXPECT_EQ(recorder.snapshot().total, 1u);    // the operation is in the process's own ring
  close(settings.ring_fd);

  test::TempDir dir;
  test::write_file(dir.file("rank0.timeline"), "COHORT-TIMELINE-1\n{\"mono_ns\": 1, \"real_ns\": 2}\n");
  std::stringstream text;
  try {
    merge_timelines({dir.file("rank0.timeline")}, text);
    FAIL() << "a timeline of version 1 was merged";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("a timeline rank file of another cohort version (COHORT-TIMELINE-1"),
              std::string::npos)
        << e.what();
  }
}

TEST(Diagnose, NamesTheRankThatStoppedFirstAndWhoWaitedForIt) {
  // Rank 1 finished #9 and went no further; ranks 0 and 2 are inside #10.
  Job job({9, 9, 9}, {10, 0, 10});
  auto lines = diagnose(job.snapshots(kSecond + 3 * kSecond));
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("rank 1 stopped first, at #9 allreduce(count=1024, float, sum)"), std::string::npos)
      << lines[0];
  EXPECT_NE(lines[0].find("ranks 0,2 waited for it in #10 allreduce"), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find("for 3.0 s"), std::string::npos) << lines[0];
}

TEST(Diagnose, EveryRankInTheSameOperationSaysHowEachLeftIt) {
  Job job({4, 4}, {5, 5});
  auto snaps = job.snapshots(2 * kSecond);
  snaps[1].process_state = "was killed by SIGKILL";
  auto lines = diagnose(snaps);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("every rank reached #5 allreduce"), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find("rank 1 running after 1.0 s, process was killed by SIGKILL"), std::string::npos) << lines[0];
}

TEST(Diagnose, StallNamesTheMissingRanksOnlyAfterTheThreshold) {
  Job job({6, 6, 6, 6}, {7, 0, 7, 0});
  int64_t entered = kSecond + 7 * 1000;
  EXPECT_FALSE(find_stall(job.snapshots(entered), entered + kSecond / 2, 1.0));
  auto snaps = job.snapshots(entered + 2 * kSecond);
  snaps[3].process_state = "stopped (SIGSTOP)";
  auto st = find_stall(snaps, entered + 2 * kSecond, 1.0);
  ASSERT_TRUE(st);
  EXPECT_EQ(st->waiting, (std::vector<int>{0, 2}));
  EXPECT_EQ(st->missing, (std::vector<int>{1, 3}));
  EXPECT_NE(st->text().find("ranks 0,2 entered #7 allreduce"), std::string::npos) << st->text();
  EXPECT_NE(st->text().find("ranks 1,3 not"), std::string::npos) << st->text();
  EXPECT_NE(st->text().find("rank 3 last #6 allreduce(count=1024, float, sum) (4.0 KiB) done, process stopped (SIGSTOP)"),
            std::string::npos)
      << st->text();
  // In step: nothing to report.
  Job steady({5, 5}, {0, 0});
  EXPECT_FALSE(find_stall(steady.snapshots(100 * kSecond), 100 * kSecond, 1.0));
}

// Another node's snapshot as the head reads it from the store keeps its age. While the node publishes,
// its ranks are current; once it stops, they are silent since its last snapshot, and the head takes
// them neither for where they were nor for inside the operation.
TEST(Diagnose, ANodeThatStoppedPublishingIsSilentSinceItsLastSnapshot) {
  // Rank 0 (on the head) entered #7; rank 1 (node 1) last showed #6 done, and its process stopped.
  Job job({6, 6}, {7, 0});
  const int64_t entered = kSecond + 7 * 1000, now = entered + 9 * kSecond;
  RankSnapshot here = job.snapshots(now)[0], theirs = job.snapshots(0)[1];
  theirs.process_state = "stopped (SIGSTOP)";
  theirs.taken_at = 900 * kSecond;  // node 1's clock, unrelated to this host's
  const std::string text = launch::publish_snapshots({theirs}, 16);
  launch::RemoteSnapshots remote({{1, "host1", {1}}}, 2, kSecond);
  // First read at `entered`: its times are moved onto this host's clock, and its age counts from there.
  auto first = remote.adopt(1, text, entered);
  ASSERT_EQ(first.size(), 1u);
  EXPECT_EQ(first[0].taken_at, entered);
  EXPECT_EQ(first[0].entries.back().t_start, theirs.entries.back().t_start + (entered - 900 * kSecond));
  // 9 s later the value is the same: the snapshot is 9 s old.
  auto later = remote.adopt(1, text, now);
  ASSERT_EQ(later.size(), 1u);
  EXPECT_EQ(later[0].taken_at, entered);
  EXPECT_FALSE(find_stall({here, later[0]}, now, 10.0, 4.0));  // under the threshold
  auto st = find_stall({here, later[0]}, now, 1.0, 4.0);
  ASSERT_TRUE(st);
  EXPECT_EQ(st->waiting, std::vector<int>{0});
  EXPECT_TRUE(st->missing.empty());
  EXPECT_EQ(st->silent, std::vector<int>{1});
  EXPECT_EQ(st->text(),
            "stall: rank 0 entered #7 allreduce(count=1024, float, sum) (4.0 KiB) 9.0 s ago; rank 1 silent (no flight "
            "recorder news from their node): rank 1 since 9.0 s ago, last seen in #6 allreduce(count=1024, float, sum) "
            "(4.0 KiB) done, process stopped (SIGSTOP)");
  // A node that goes on publishing is current: its rank has not entered #7.
  theirs.taken_at += 9 * kSecond;
  auto fresh = remote.adopt(1, launch::publish_snapshots({theirs}, 16), now);
  EXPECT_EQ(fresh[0].taken_at, now);
  st = find_stall({here, fresh[0]}, now, 1.0, 4.0);
  ASSERT_TRUE(st);
  EXPECT_TRUE(st->silent.empty());
  EXPECT_NE(st->text().find("; rank 1 not: rank 1 last #6 allreduce(count=1024, float, sum) (4.0 KiB) done, process "
                            "stopped (SIGSTOP)"),
            std::string::npos)
      << st->text();
  // Last seen inside #7 long ago is not inside #7 now: no "every rank has been in #7".
  Job both({6, 6}, {7, 7});
  auto snaps = both.snapshots(now);
  snaps[1].taken_at = entered;
  st = find_stall(snaps, now, 1.0, 4.0);
  ASSERT_TRUE(st);
  EXPECT_FALSE(st->all_inside);
  EXPECT_NE(st->text().find("rank 1 silent (no flight recorder news from their node): rank 1 since 9.0 s ago, last "
                            "seen in #7 allreduce(count=1024, float, sum) (4.0 KiB) running"),
            std::string::npos)
      << st->text();
  // A node that never published: its ranks are unknown at first (no warning), then silent since the
  // attempt began.
  launch::RemoteSnapshots unknown({{1, "host1", {1}}}, 2, kSecond);
  auto none = unknown.adopt(1, std::nullopt, entered + 2 * kSecond);
  ASSERT_EQ(none.size(), 1u);
  EXPECT_EQ(none[0].rank, 1);
  here.taken_at = entered + 2 * kSecond;
  EXPECT_FALSE(find_stall({here, none[0]}, entered + 2 * kSecond, 1.0, 4.0));
  here.taken_at = now;
  st = find_stall({here, unknown.adopt(1, std::nullopt, now)[0]}, now, 1.0, 4.0);
  ASSERT_TRUE(st);
  EXPECT_NE(st->text().find("rank 1 silent (no flight recorder news from their node): rank 1 since 9.0 s ago, its "
                            "node has published nothing"),
            std::string::npos)
      << st->text();
}

TEST(Diagnose, MismatchNamesBothSides) {
  Job job({2, 2, 2}, {0, 0, 0});
  Ring& r2 = job.rings[2];
  ring_append(r2.header(), allreduce(3, 512, 5));
  ring_append(job.rings[0].header(), allreduce(3, 1024, 5));
  auto m = find_mismatch(job.snapshots(0));
  ASSERT_TRUE(m);
  EXPECT_EQ(m->text(),
            "mismatch at operation #3: rank 0 called #3 allreduce(count=1024, float, sum) (4.0 KiB) but rank 2 called "
            "#3 allreduce(count=512, float, sum) (2.0 KiB)");
}

TEST(Dump, RoundTripsThroughJsonAndReadsADirectory) {
  Job job({3, 2}, {0, 3});
  test::TempDir dir;
  auto snaps = job.snapshots(42);
  for (const auto& s : snaps) write_dump(dir.file("rank" + std::to_string(s.rank) + ".json"), s);
  auto back = read_dump_dir(dir.path());
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(to_json(back[1]), to_json(snaps[1]));
  EXPECT_EQ(diagnose(back), diagnose(snaps));
  test::write_file(dir.file("rank7.json"), "{\"format\": \"something else\"}");
  try {
    read_dump_dir(dir.path());
    FAIL() << "a foreign file was read as a dump";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank7.json: not a cohort flight recorder dump"), std::string::npos) << e.what();
  }
}

TEST(Timeline, ARunOfBackToBackIdenticalShortOperationsIsOneSlice) {
  OpRun run;
  OpBegin first = allreduce(1, 2, 1000000);
  run.start(first, first.t_start + 300, true);  // 0.3 us long
  OpBegin next = allreduce(2, 2, first.t_start + 350);
  EXPECT_TRUE(run.extends(next));            // back to back
  next.t_start = first.t_start + 5000;
  EXPECT_FALSE(run.extends(next));           // 5 us later: work in between, drawn on its own
  next.t_start = first.t_start + 350;
  next.count = 3;
  EXPECT_FALSE(run.extends(next));           // another call
  next.count = 2;
  next.t_queued = 1;
  EXPECT_FALSE(run.extends(next));           // async: its queue time is worth seeing
  // A long operation never starts a run of slices 20 us apart.
  run.start(first, first.t_start + 50000, true);
  next.t_queued = 0;
  next.t_start = first.t_start + 60000;
  EXPECT_FALSE(run.extends(next));
  // Nothing joins a failed operation.
  run.start(first, first.t_start + 300, false);
  next.t_start = first.t_start + 350;
  EXPECT_FALSE(run.extends(next));
}

TEST(Timeline, MergesRanksIntoAChromeTraceWithMonotoneTracks) {
  test::TempDir dir;
  for (int r = 0; r < 2; ++r) {
    TimelineWriter w(dir.file("rank{rank}.timeline"));
    w.set_identity(r, 2, "host");
    int64_t t = monotonic_ns();
    w.add_span("backward", -1, t, t + 5000);
    w.add_instant("bucket ready", 0, t + 1000);
    for (uint32_t s = 3; s >= 1; --s) {  // written out of order on purpose
      OpRecord op;
      op.kind = OpKind::kAllreduce;
      op.comm = kWorld;
      op.seq = s;
      op.state = OpState::kDone;
      op.t_start = t + s * 2000;
      op.t_end = op.t_start + 1500;
      w.add_op(op);
    }
    OpRecord loop;  // a run of 1000 (OpRun), after the three above
    loop.kind = OpKind::kAllreduce;
    loop.comm = kWorld;
    loop.seq = 4;
    loop.state = OpState::kDone;
    loop.t_start = t + 10000;
    loop.t_end = t + 10000 + 300000;
    w.add_op(loop, 1000, 1003);
    w.flush();
  }
  auto files = timeline_rank_files(dir.path());
  ASSERT_EQ(files.size(), 2u);
  std::stringstream text;
  auto summary = merge_timelines(files, text);
  EXPECT_EQ(summary.ranks, 2);
  EXPECT_EQ(summary.events, 12u);
  auto trace = nlohmann::json::parse(text.str());
  ASSERT_TRUE(trace["traceEvents"].is_array());
  std::map<std::pair<int, int>, double> last_ts;
  std::set<int> pids;
  int complete = 0;
  for (const auto& e : trace["traceEvents"]) {
    ASSERT_TRUE(e.contains("ph") && e.contains("pid") && e.contains("tid") && e.contains("name")) << e;
    std::string ph = e["ph"];
    if (ph == "M") {
      ASSERT_TRUE(e["args"].contains("name") || e["args"].contains("sort_index")) << e;
      continue;
    }
    ASSERT_TRUE(e["ts"].is_number()) << e;
    if (ph == "X") {
      ASSERT_TRUE(e["dur"].is_number() && e["dur"].get<double>() >= 0) << e;
      ++complete;
    }
    auto key = std::make_pair(e["pid"].get<int>(), e["tid"].get<int>());
    double ts = e["ts"];
    if (last_ts.count(key)) {
      EXPECT_GE(ts, last_ts[key]) << e;
    }
    last_ts[key] = ts;
    pids.insert(key.first);
  }
  EXPECT_EQ(pids, (std::set<int>{0, 1}));
  EXPECT_EQ(complete, 10);
  bool run_seen = false;
  for (const auto& e : trace["traceEvents"])
    if (e["name"] == "allreduce x1000") {
      run_seen = true;
      EXPECT_EQ(e["args"]["repeat"], 1000);
      EXPECT_EQ(e["args"]["last_seq"], 1003);
      EXPECT_DOUBLE_EQ(e["args"]["mean_us"].get<double>(), 0.3);
    }
  EXPECT_TRUE(run_seen);
}

}  // namespace
}  // namespace cohort::trace
