//! Proving knowledge of the job's secret without sending it, and keys derived from it.
//!
//! - [`Key`]: 32 bytes derived from the job token with HMAC-SHA256 (RustCrypto's `hmac` and
//!   `sha2`); [`Key::derive`] makes a sub-key for a role or a round (`HMAC(key, label)`), so a
//!   holder of a sub-key cannot work out the key it came from.
//! - Challenge-response: each side sends a fresh nonce (`nonce`, from the operating system's
//!   generator through `getrandom`) and answers with `Key::prove` — an HMAC over both nonces
//!   and its role — which the other side checks in constant time (`Key::verify`, `subtle`).
//!   A recorded answer is useless against a fresh nonce, and a side that does not hold the key
//!   (a port squatter) learns nothing it could use and is refused.
//! - `Identity`: a signing key of one rank for one rendezvous (Ed25519, `ed25519-dalek`),
//!   whose public half the rank publishes once with its address. Every rank holds the job's
//!   key, so the key cannot tell ranks apart; a signature can: a process that holds the job's
//!   key but not rank `r`'s identity cannot pass for rank `r`.

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use hmac::{Hmac, Mac};
use sha2::Sha256;
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

    /// The proof that `role` holds this key in an exchange with `client` and `server` nonces
    /// (and `context`: what else both sides must agree on).
    pub fn prove(&self, role: &str, client: &[u8], server: &[u8], context: &[u8]) -> [u8; LEN] {
        hmac(&self.0, &[role.as_bytes(), client, server, context])
    }

    /// Whether `proof` is [`Self::prove`]'s answer for the same inputs (constant time).
    pub fn verify(
        &self,
        proof: &[u8],
        role: &str,
        client: &[u8],
        server: &[u8],
        context: &[u8],
    ) -> bool {
        let expected = self.prove(role, client, server, context);
        proof.len() == LEN && bool::from(expected.ct_eq(proof))
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

    #[test]
    fn proofs_bind_the_key_the_role_and_both_nonces() {
        let k = Key::from_token("tok");
        let (c, s) = (nonce(), nonce());
        assert_ne!(c, s, "fresh nonces");
        let p = k.prove("client", &c, &s, b"");
        assert!(k.verify(&p, "client", &c, &s, b""));
        assert!(!k.verify(&p, "server", &c, &s, b""), "another role");
        assert!(
            !k.verify(&p, "client", &c, &nonce(), b""),
            "a replay against a new nonce"
        );
        assert!(
            !Key::from_token("other").verify(&p, "client", &c, &s, b""),
            "another key"
        );
        assert!(!k.verify(&p[..31], "client", &c, &s, b""));
        assert!(!k.verify(&p, "client", &c, &s, b"x"), "another context");
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
