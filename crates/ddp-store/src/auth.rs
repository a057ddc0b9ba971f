//! Proving knowledge of the job's secret without sending it, and keys derived from it.
//!
//! - [`Key`]: 32 bytes derived from the job token with HMAC-SHA256 (RustCrypto's `hmac` and
//!   `sha2`); [`Key::derive`] makes a sub-key for a role or a round (`HMAC(key, label)`), so a
//!   holder of a sub-key cannot work out the key it came from; [`Key::rank_key`] is one rank's
//!   own key in a round.
//! - [`Exchange`]: a password-authenticated key exchange over a key (SPAKE2 on Ed25519,
//!   RustCrypto's `spake2`), then each side confirms the shared session key
//!   ([`Session::confirm`], an HMAC checked in constant time with `subtle`). Neither a recorded
//!   exchange nor one an attacker starts gives anything to test a guess of the token against
//!   off line: an attacker who does not hold the key tests one guess per connection, the one
//!   it committed to, and a side that does not hold the key (a port squatter) is refused.
//! - `Identity`: a signing key of one rank for one rendezvous (Ed25519, `ed25519-dalek`),
//!   whose public half the rank publishes once with its address; the links between ranks are
//!   authenticated by these signatures alone (the identities come from the authenticated
//!   store, where, under `ddprun`, only rank `r` may write rank `r`'s entry).

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use spake2::{Ed25519Group, Spake2};
use subtle::ConstantTimeEq;

type HmacSha256 = Hmac<Sha256>;

/// Length of a nonce and of a proof, in bytes.
pub const LEN: usize = 32;

/// A secret key of the job, or of one role or round of it.
#[derive(Clone, PartialEq, Eq)]
pub struct Key([u8; LEN]);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(<secret>)")
    }
}

fn hmac(key: &[u8], parts: &[&[u8]]) -> [u8; LEN] {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes a key of any length");
    mac.update(&framed(parts));
    mac.finalize().into_bytes().into()
}

/// The parts as one message, each preceded by its length, so that two different splits
/// never read alike.
fn framed(parts: &[&[u8]]) -> Vec<u8> {
    let mut m = Vec::with_capacity(parts.iter().map(|p| p.len() + 8).sum());
    for p in parts {
        m.extend_from_slice(&(p.len() as u64).to_le_bytes());
        m.extend_from_slice(p);
    }
    m
}

/// Length of a public identity (an Ed25519 verifying key).
pub const PUBLIC_LEN: usize = 32;
/// Length of a signature (Ed25519).
pub const SIGNATURE_LEN: usize = 64;

/// A rank's signing key for one rendezvous: fresh from the operating system's generator,
/// never sent anywhere; its public half is published with the rank's address.
#[doc(hidden)]
pub struct Identity(SigningKey);

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Identity(<secret>)")
    }
}

impl Identity {
    /// A fresh identity.
    pub fn generate() -> Identity {
        Identity(SigningKey::from_bytes(&nonce()))
    }

    /// The public half, to publish.
    pub fn public(&self) -> [u8; PUBLIC_LEN] {
        self.0.verifying_key().to_bytes()
    }

    /// The signature of `role` over `parts`.
    pub fn sign(&self, role: &str, parts: &[&[u8]]) -> [u8; SIGNATURE_LEN] {
        let mut all = vec![role.as_bytes()];
        all.extend_from_slice(parts);
        self.0.sign(&framed(&all)).to_bytes()
    }
}

/// Whether `signature` is the signature of `role` over `parts` by the identity whose public
/// half is `public` (strict verification: no malleable signatures).
#[doc(hidden)]
pub fn signed_by(public: &[u8], signature: &[u8], role: &str, parts: &[&[u8]]) -> bool {
    let (Ok(public), Ok(signature)) = (
        <[u8; PUBLIC_LEN]>::try_from(public),
        <[u8; SIGNATURE_LEN]>::try_from(signature),
    ) else {
        return false;
    };
    let Ok(key) = VerifyingKey::from_bytes(&public) else {
        return false;
    };
    let mut all = vec![role.as_bytes()];
    all.extend_from_slice(parts);
    key.verify_strict(&framed(&all), &Signature::from_bytes(&signature))
        .is_ok()
}

impl Key {
    /// The key of a job token (`DDP_JOB_TOKEN`).
    pub fn from_token(token: &str) -> Key {
        Key(hmac(token.as_bytes(), &[b"ddp-comm job key v1"]))
    }

    /// The sub-key for `label` (a role, a round): `HMAC(self, label)`.
    pub fn derive(&self, label: &str) -> Key {
        Key(hmac(&self.0, &[b"derive", label.as_bytes()]))
    }

    /// The key as a token string (64 hex digits), to hand to a process that derives its own
    /// keys from it (the ranks of a round).
    pub fn to_token(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The key of a token written by [`Self::to_token`] (64 hex digits), as it was: a rank
    /// given its own key by `ddprun` (see [`Self::rank_key`]). `None` for anything else.
    pub fn from_hex(token: &str) -> Option<Key> {
        let bytes = token.as_bytes();
        if bytes.len() != 2 * LEN {
            return None;
        }
        let mut k = [0u8; LEN];
        if !bytes.iter().all(u8::is_ascii_hexdigit) {
            return None;
        }
        for (i, pair) in bytes.chunks(2).enumerate() {
            let hex = std::str::from_utf8(pair).ok()?;
            k[i] = u8::from_str_radix(hex, 16).ok()?;
        }
        Some(Key(k))
    }

    /// Rank `rank`'s own key in the round whose key is `self`: what `ddprun` gives that rank
    /// (as [`Self::to_token`]), and what rank 0's store checks a client claiming `rank`
    /// against. A rank's key says nothing about another rank's or the round's.
    pub fn rank_key(&self, rank: u32) -> Key {
        self.derive(&format!("rank/{rank}"))
    }
}

/// The two sides of an [`Exchange`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The side that connects (sends the first message).
    Client,
    /// The side that accepts.
    Server,
}

/// One password-authenticated key exchange in progress (SPAKE2 over Ed25519): the key is the
/// password, `context` (a role, a claimed rank) is bound into both sides' identities, so two
/// sides that differ in either end with different session keys.
pub struct Exchange(Spake2<Ed25519Group>);

impl std::fmt::Debug for Exchange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Exchange(<secret>)")
    }
}

impl Exchange {
    /// Starts `side`'s half of an exchange over `key` and `context`: the state, and the message
    /// to send the other side (it reveals nothing about the key).
    pub fn start(side: Side, key: &Key, context: &[u8]) -> (Exchange, Vec<u8>) {
        let (password, client, server) = Self::inputs(key, context);
        let (state, message) = match side {
            Side::Client => Spake2::<Ed25519Group>::start_a(&password, &client, &server),
            Side::Server => Spake2::<Ed25519Group>::start_b(&password, &client, &server),
        };
        (Exchange(state), message)
    }

    /// The password and both identities of an exchange over `key` and `context`.
    fn inputs(key: &Key, context: &[u8]) -> (spake2::Password, spake2::Identity, spake2::Identity) {
        (
            spake2::Password::new(key.0),
            spake2::Identity::new(&framed(&[b"ddp exchange client", context])),
            spake2::Identity::new(&framed(&[b"ddp exchange server", context])),
        )
    }

    /// A client's start whose ephemeral secret comes from `rng`: what an attacker who replays
    /// its own ephemeral with other guesses would compute (the offline-guessing test).
    #[cfg(test)]
    pub(crate) fn start_client_with(
        key: &Key,
        context: &[u8],
        rng: impl rand_core::CryptoRng + rand_core::RngCore,
    ) -> (Exchange, Vec<u8>) {
        let (password, client, server) = Self::inputs(key, context);
        let (state, message) =
            Spake2::<Ed25519Group>::start_a_with_rng(&password, &client, &server, rng);
        (Exchange(state), message)
    }

    /// The session key, given the other side's message; `None` for a message that is not a
    /// valid one. The two sides' keys are equal only if both hold the same key and context;
    /// [`Session::confirm`] tells.
    pub fn finish(self, theirs: &[u8]) -> Option<Session> {
        let key = self.0.finish(theirs).ok()?;
        Some(Session(hmac(&key, &[b"ddp session"])))
    }
}

/// The key both sides of a finished [`Exchange`] share when they hold the same key.
pub struct Session([u8; LEN]);

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Session(<secret>)")
    }
}

impl Session {
    /// `role`'s confirmation that it holds the session key (an HMAC of `role` and `parts`).
    pub fn confirm(&self, role: &str, parts: &[&[u8]]) -> [u8; LEN] {
        let mut all = vec![role.as_bytes()];
        all.extend_from_slice(parts);
        hmac(&self.0, &all)
    }

    /// Whether `mac` is [`Self::confirm`]'s answer for `role` and `parts` (constant time).
    pub fn verify(&self, mac: &[u8], role: &str, parts: &[&[u8]]) -> bool {
        let expected = self.confirm(role, parts);
        mac.len() == LEN && bool::from(expected.ct_eq(mac))
    }
}

/// A fresh random nonce from the operating system.
#[doc(hidden)]
pub fn nonce() -> [u8; LEN] {
    let mut n = [0u8; LEN];
    getrandom::fill(&mut n).expect("the operating system's random generator");
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both sides of an exchange over `key`/`context` (client) and `theirs`/`their_context`
    /// (server): whether the server's confirmation checks on the client and the client's on
    /// the server.
    fn exchange(key: &Key, context: &[u8], theirs: &Key, their_context: &[u8]) -> (bool, bool) {
        let (client, to_server) = Exchange::start(Side::Client, key, context);
        let (server, to_client) = Exchange::start(Side::Server, theirs, their_context);
        let (c, s) = (client.finish(&to_client), server.finish(&to_server));
        let (c, s) = (c.unwrap(), s.unwrap());
        let server_says = s.confirm("server", &[b"x"]);
        let client_says = c.confirm("client", &[b"x"]);
        (
            c.verify(&server_says, "server", &[b"x"]),
            s.verify(&client_says, "client", &[b"x"]),
        )
    }

    #[test]
    fn an_exchange_confirms_only_the_same_key_and_context() {
        let k = Key::from_token("tok");
        assert_eq!(exchange(&k, b"rank 1", &k, b"rank 1"), (true, true));
        let other = Key::from_token("other");
        assert_eq!(exchange(&k, b"rank 1", &other, b"rank 1"), (false, false));
        assert_eq!(exchange(&k, b"rank 1", &k, b"rank 2"), (false, false));
        let (c, m) = Exchange::start(Side::Client, &k, b"");
        assert!(c.finish(&m[..10]).is_none(), "a truncated message");
        let (_, m1) = Exchange::start(Side::Client, &k, b"");
        let (_, m2) = Exchange::start(Side::Client, &k, b"");
        assert_ne!(m1, m2, "fresh messages every time");
        let s = Exchange::start(Side::Server, &k, b"")
            .0
            .finish(&m1)
            .unwrap();
        let mac = s.confirm("server", &[]);
        assert!(!s.verify(&mac, "client", &[]), "another role");
        assert!(!s.verify(&mac[..31], "server", &[]));
        assert_eq!(format!("{s:?}"), "Session(<secret>)");
    }

    #[test]
    fn rank_keys_round_trip_as_tokens_and_differ_by_rank() {
        let round = Key::from_token("round");
        let one = round.rank_key(1);
        assert_ne!(one, round.rank_key(2));
        assert_ne!(one, round);
        assert_eq!(Key::from_hex(&one.to_token()), Some(one.clone()));
        assert_eq!(Key::from_hex("not hex"), None);
        assert_eq!(Key::from_hex(&"+1".repeat(32)), None);
        assert_eq!(Key::from_hex(&format!("{}0", one.to_token())), None);
    }

    #[test]
    fn signatures_bind_the_identity_the_role_and_the_parts() {
        let me = Identity::generate();
        let other = Identity::generate();
        assert_ne!(me.public(), other.public());
        let n = nonce();
        let sig = me.sign("hello", &[&n, b"rank 1"]);
        assert!(signed_by(&me.public(), &sig, "hello", &[&n, b"rank 1"]));
        assert!(!signed_by(&other.public(), &sig, "hello", &[&n, b"rank 1"]));
        assert!(!signed_by(&me.public(), &sig, "reply", &[&n, b"rank 1"]));
        assert!(!signed_by(&me.public(), &sig, "hello", &[&n, b"rank 2"]));
        assert!(!signed_by(
            &me.public(),
            &sig,
            "hello",
            &[&nonce(), b"rank 1"]
        ));
        assert!(!signed_by(
            &me.public(),
            &sig[..63],
            "hello",
            &[&n, b"rank 1"]
        ));
        assert!(!signed_by(&[0; 32], &sig, "hello", &[&n, b"rank 1"]));
        assert_eq!(format!("{me:?}"), "Identity(<secret>)");
    }

    #[test]
    fn derived_keys_differ_by_label_and_do_not_reveal_their_parent() {
        let job = Key::from_token("tok");
        let a = job.derive("launchers");
        assert_ne!(a, job.derive("ranks/round/0"));
        assert_ne!(job.derive("ranks/round/0"), job.derive("ranks/round/1"));
        assert_eq!(
            a,
            Key::from_token("tok").derive("launchers"),
            "deterministic"
        );
        let t = a.to_token();
        assert_eq!(t.len(), 64);
        assert!(!t.contains("tok"));
        assert_eq!(format!("{a:?}"), "Key(<secret>)");
    }
}
