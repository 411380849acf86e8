#pragma once
// A Slurm per-node job's token through munge (docs/security.md, "How each mode gets its token").
//
// The launchers of `srun cohort run` start apart, on different nodes, with nothing secret in common
// but the cluster's munge realm. Node 0's launcher makes the job token and encodes it as one munge
// credential per node, each restricted to the job's uid (`munge --restrict-uid`); its store serves
// them to anyone before authentication (a store notice), and each other node's launcher decodes its
// own with `unmunge`. munged checks the caller's uid and the credential's MAC: another user, or a
// host outside the realm, can fetch a credential but never read the token in it. One credential per
// node because munged refuses a second decode of a credential (replay), and nodes may share a munged.
//
// The munge and unmunge commands of the `munge` package are used (no libmunge at build time), with a
// deadline on each run.

#include <chrono>
#include <string>
#include <sys/types.h>

#include "launch/parsers.h"

namespace cohort::launch::munge {

// Where this node's munged listens: COHORT_MUNGE_SOCKET; else the socket= of AuthInfo in Slurm's
// configuration (SLURM_CONF, else /etc/slurm/slurm.conf), which is the munged Slurm itself uses;
// else "" (munge's compiled-in default, /run/munge/munge.socket.2). `source` says which.
std::string socket_path(const EnvMap& env, std::string* source);

// Whether munge can be asked here at all: the munge commands are on PATH and munged's socket exists.
// False with one line saying which is missing (the job then runs open, or --require-auth refuses it).
bool available(const std::string& socket, std::string* why);

// The store notice that holds node `node`'s credential.
std::string notice_name(int node);

struct Outcome {
  bool ok = false;
  std::string value;  // the credential (encode) or the payload (decode)
  std::string why;    // one line when !ok: which command, and what it said
};

// A credential holding `payload` that only `uid` can decode, valid for munged's longest TTL.
Outcome encode(const std::string& payload, uid_t uid, const std::string& socket, std::chrono::milliseconds timeout);

// The payload of `credential`, which must have been encoded by `encoder_uid` (a credential of
// another user's, handed over by a store that is not the job's, is refused).
Outcome decode(const std::string& credential, uid_t encoder_uid, const std::string& socket,
               std::chrono::milliseconds timeout);

}  // namespace cohort::launch::munge
