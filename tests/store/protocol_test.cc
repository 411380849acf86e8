// Tests of the pure frame codec (the part the fuzz target drives) and of the token proof.
#include <gtest/gtest.h>

#include "store/auth.h"
#include "store/protocol.h"

namespace cohort {
namespace {

using proto::DecodeStatus;
using proto::Op;

TEST(StoreProtocol, EncodedRequestsDecodeBack) {
  std::string buf;
  proto::encode_set(buf, 7, "key", std::string("v\0l", 3));
  proto::encode_keys(buf, Op::kWait, 8, {"a", "bb", ""}, 1234);
  proto::encode_multi_set(buf, 9, {"x", "y"}, {"1", "2"});
  proto::encode_add(buf, 10, "n", -5);
  proto::encode_lease(buf, 11, 2000, {"gone/a"}, {"lost a"});

  proto::FrameView f;
  proto::Request r;
  std::string err;
  size_t off = 0;
  auto d = proto::decode_frame(buf.data(), buf.size(), proto::kDefaultMaxFrame, &f);
  ASSERT_EQ(d.status, DecodeStatus::kFrame);
  ASSERT_TRUE(proto::parse_request(f, &r, &err)) << err;
  EXPECT_EQ(r.op, Op::kSet);
  EXPECT_EQ(r.id, 7u);
  EXPECT_EQ(r.key, "key");
  EXPECT_EQ(r.value, std::string_view("v\0l", 3));
  off += d.consumed;

  d = proto::decode_frame(buf.data() + off, buf.size() - off, proto::kDefaultMaxFrame, &f);
  ASSERT_EQ(d.status, DecodeStatus::kFrame);
  ASSERT_TRUE(proto::parse_request(f, &r, &err)) << err;
  EXPECT_EQ(r.op, Op::kWait);
  EXPECT_EQ(r.timeout_ms, 1234u);
  ASSERT_EQ(r.keys.size(), 3u);
  EXPECT_EQ(r.keys[1], "bb");
  EXPECT_EQ(r.keys[2], "");
  off += d.consumed;

  d = proto::decode_frame(buf.data() + off, buf.size() - off, proto::kDefaultMaxFrame, &f);
  ASSERT_TRUE(proto::parse_request(f, &r, &err)) << err;
  ASSERT_EQ(r.values.size(), 2u);
  EXPECT_EQ(r.values[1], "2");
  off += d.consumed;

  d = proto::decode_frame(buf.data() + off, buf.size() - off, proto::kDefaultMaxFrame, &f);
  ASSERT_TRUE(proto::parse_request(f, &r, &err)) << err;
  EXPECT_EQ(r.delta, -5);
  off += d.consumed;

  d = proto::decode_frame(buf.data() + off, buf.size() - off, proto::kDefaultMaxFrame, &f);
  ASSERT_TRUE(proto::parse_request(f, &r, &err)) << err;
  EXPECT_EQ(r.op, Op::kLease);
  EXPECT_EQ(r.timeout_ms, 2000u);
  ASSERT_EQ(r.keys.size(), 1u);
  EXPECT_EQ(r.keys[0], "gone/a");
  EXPECT_EQ(r.values[0], "lost a");
  EXPECT_EQ(off + d.consumed, buf.size());
}

TEST(StoreProtocol, AFenceRequestCarriesItsKeyAndEpoch) {
  std::string buf;
  proto::encode_fence(buf, 7, "cohort/launch/j/rdzv/epoch", 12);
  proto::FrameView f;
  auto d = proto::decode_frame(buf.data(), buf.size(), proto::kDefaultMaxFrame, &f);
  ASSERT_EQ(d.status, DecodeStatus::kFrame);
  proto::Request r;
  std::string err;
  ASSERT_TRUE(proto::parse_request(f, &r, &err)) << err;
  EXPECT_EQ(r.op, Op::kFence);
  EXPECT_EQ(r.id, 7u);
  EXPECT_EQ(r.key, "cohort/launch/j/rdzv/epoch");
  EXPECT_EQ(r.delta, 12);
  EXPECT_TRUE(proto::is_request(Op::kFence));
  EXPECT_STREQ(proto::op_name(Op::kFence), "fence");
}

TEST(StoreProtocol, PartialFramesNeedMoreBytes) {
  std::string buf;
  proto::encode_set(buf, 1, "key", "value");
  proto::FrameView f;
  for (size_t n = 0; n < buf.size(); ++n) {
    EXPECT_EQ(proto::decode_frame(buf.data(), n, proto::kDefaultMaxFrame, &f).status, DecodeStatus::kNeedMore) << n;
  }
  EXPECT_EQ(proto::decode_frame(buf.data(), buf.size(), proto::kDefaultMaxFrame, &f).status, DecodeStatus::kFrame);
}

TEST(StoreProtocol, BadLengthsAreRejectedBeforeTheBytesArrive) {
  proto::FrameView f;
  std::string tiny("\x02\x00\x00\x00", 4);
  EXPECT_EQ(proto::decode_frame(tiny.data(), tiny.size(), 1024, &f).status, DecodeStatus::kBad);
  std::string huge("\x01\x10\x00\x00", 4);  // 4097 > 1024
  auto d = proto::decode_frame(huge.data(), huge.size(), 1024, &f);
  EXPECT_EQ(d.status, DecodeStatus::kBad);
  EXPECT_EQ(d.length, 4097u);
}

TEST(StoreProtocol, MalformedRequestsSayWhy) {
  proto::Request r;
  std::string err;
  std::string buf;
  proto::Writer(buf).begin(static_cast<Op>(200), 1).end();
  proto::FrameView f;
  proto::decode_frame(buf.data(), buf.size(), proto::kDefaultMaxFrame, &f);
  EXPECT_FALSE(proto::parse_request(f, &r, &err));
  EXPECT_EQ(err, "unknown operation 200");

  buf.clear();
  proto::Writer(buf).begin(Op::kDelete, 1).bytes("k").u8(0).end();  // trailing byte
  proto::decode_frame(buf.data(), buf.size(), proto::kDefaultMaxFrame, &f);
  EXPECT_FALSE(proto::parse_request(f, &r, &err));
  EXPECT_EQ(err, "malformed delete request: trailing bytes");

  buf.clear();
  proto::Writer(buf).begin(Op::kCheck, 1).u32(0x7fffffff).end();  // a count the payload cannot hold
  proto::decode_frame(buf.data(), buf.size(), proto::kDefaultMaxFrame, &f);
  EXPECT_FALSE(proto::parse_request(f, &r, &err));
  EXPECT_EQ(err, "malformed check request: payload too short");
}

TEST(StoreProtocol, HandshakeRoundTrip) {
  std::string buf;
  proto::encode_challenge(buf, true, std::string(32, 'n'));
  proto::FrameView f;
  ASSERT_EQ(proto::decode_frame(buf.data(), buf.size(), 1024, &f).status, DecodeStatus::kFrame);
  proto::Challenge ch;
  ASSERT_TRUE(proto::parse_challenge(f.payload, &ch));
  EXPECT_EQ(ch.magic, proto::kMagic);
  EXPECT_EQ(ch.version, proto::kVersion);
  EXPECT_TRUE(ch.auth_required);
  EXPECT_EQ(ch.nonce.size(), 32u);
}

TEST(StoreAuth, ProofDependsOnTokenAndNonce) {
  std::string n1 = store_auth::make_nonce(), n2 = store_auth::make_nonce();
  EXPECT_NE(n1, n2);
  std::string p = store_auth::proof("token", n1);
  EXPECT_EQ(p.size(), 32u);
  EXPECT_TRUE(store_auth::verify("token", n1, p));
  EXPECT_FALSE(store_auth::verify("token", n2, p));   // a recorded proof is useless for another nonce
  EXPECT_FALSE(store_auth::verify("tokeN", n1, p));
  EXPECT_FALSE(store_auth::verify("token", n1, ""));
  EXPECT_EQ(p.find("token"), std::string::npos);      // the token is not in what travels
}

}  // namespace
}  // namespace cohort
