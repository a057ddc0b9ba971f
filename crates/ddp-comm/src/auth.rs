//! Proving knowledge of the job's secret without sending it, and keys derived from it.
//!
//! - [`Key`]: 32 bytes derived from the job token with HMAC-SHA256 (RustCrypto's `hmac` and
//!   `sha2`); [`Key::derive`] makes a sub-key for a role or a round (`HMAC(key, label)`), so a
//!   holder of a sub-key cannot work out the key it came from.
//! - Challenge-response: each side sends a fresh nonce ([`nonce`], from the operating system's
//!   generator through `getrandom`) and answers with [`Key::prove`] — an HMAC over both nonces
//!   and its role — which the other side checks in constant time ([`Key::verify`], `subtle`).
//!   A recorded answer is useless against a fresh nonce, and a side that does not hold the key
//!   (a port squatter) learns nothing it could use and is refused.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

type HmacSha256 = Hmac<Sha256>;

/// Length of a nonce and of a proof, in bytes.
pub(crate) const LEN: usize = 32;

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
    for p in parts {
        // Each part's length first, so that two different splits never hash alike.
        mac.update(&(p.len() as u64).to_le_bytes());
        mac.update(p);
    }
    mac.finalize().into_bytes().into()
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
    pub(crate) fn prove(
        &self,
        role: &str,
        client: &[u8],
        server: &[u8],
        context: &[u8],
    ) -> [u8; LEN] {
        hmac(&self.0, &[role.as_bytes(), client, server, context])
    }

    /// Whether `proof` is [`Self::prove`]'s answer for the same inputs (constant time).
    pub(crate) fn verify(
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
pub(crate) fn nonce() -> [u8; LEN] {
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
