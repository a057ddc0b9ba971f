//! The bundle's archive: one `tar.xz` of the stripped binaries, compressed with a dictionary
//! larger than one binary, so that the bytes the CUDA binaries share (LLVM, Burn, CubeCL) are
//! stored about once. Unpacked with the same Rust xz decoder on the GPU machine, which may
//! have no `xz` and no Python.

use std::fs::File;
use std::io::{self, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use liblzma::read::XzDecoder;
use liblzma::stream::{Check, Filters, LzmaOptions, Stream};
use liblzma::write::XzEncoder;
use thiserror::Error;

/// The archive's file name inside the bundle folder.
pub const ARCHIVE: &str = "bins.tar.xz";

/// The LZMA2 dictionary: 512 MiB, larger than any one binary (`xz --lzma2=preset=9,dict=512MiB`).
pub const DICT_SIZE: u32 = 512 << 20;

/// The LZMA2 preset the dictionary is set on (9: the slowest and best).
pub const PRESET: u32 = 9;

/// An error of packing or unpacking.
#[derive(Debug, Error)]
pub enum BundleError {
    /// The LZMA2 options or the xz encoder could not be set up.
    #[error("xz encoder setup: {0}")]
    Encoder(#[from] liblzma::stream::Error),
    /// Reading a file, writing the archive, or unpacking it failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file or folder.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> BundleError + 'a {
    move |source| BundleError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// One file of the archive: its name there and where it is read from.
#[derive(Debug, Clone)]
pub struct Entry {
    /// The file name in the archive (no folders).
    pub name: String,
    /// The file to read.
    pub source: PathBuf,
}

/// Writes `entries` into the xz-compressed tar `archive` (LZMA2 at [`PRESET`] with a
/// dictionary of `dict_size` bytes, one thread, CRC-64). Modes are kept (executable or not);
/// owners and times are not. Returns the bytes packed (before compression).
pub fn pack(entries: &[Entry], archive: &Path, dict_size: u32) -> Result<u64, BundleError> {
    let mut opts = LzmaOptions::new_preset(PRESET)?;
    opts.dict_size(dict_size);
    let mut filters = Filters::new();
    filters.lzma2(&opts);
    let stream = Stream::new_stream_encoder(&filters, Check::Crc64)?;
    let file = File::create(archive).map_err(io_err("cannot create", archive))?;
    let mut tar = tar::Builder::new(XzEncoder::new_stream(BufWriter::new(file), stream));
    tar.mode(tar::HeaderMode::Deterministic);
    tar.follow_symlinks(true);
    let mut raw = 0;
    for e in entries {
        raw += std::fs::metadata(&e.source)
            .map_err(io_err("cannot read", &e.source))?
            .len();
        tar.append_path_with_name(&e.source, &e.name)
            .map_err(io_err("cannot pack", &e.source))?;
    }
    let xz = tar.into_inner().map_err(io_err("cannot write", archive))?;
    xz.finish()
        .and_then(|mut w| w.flush())
        .map_err(io_err("cannot write", archive))?;
    Ok(raw)
}

/// Unpacks `archive` into the folder `dest` (created if missing; files in it are replaced)
/// with the file modes of the archive. Returns the names unpacked, in archive order.
pub fn unpack(archive: &Path, dest: &Path) -> Result<Vec<String>, BundleError> {
    std::fs::create_dir_all(dest).map_err(io_err("cannot create", dest))?;
    let file = File::open(archive).map_err(io_err("cannot open", archive))?;
    let mut tar = tar::Archive::new(XzDecoder::new(BufReader::new(file)));
    tar.set_preserve_permissions(true);
    let mut names = Vec::new();
    for entry in tar.entries().map_err(io_err("cannot read", archive))? {
        let mut entry = entry.map_err(io_err("cannot read", archive))?;
        let name = entry
            .path()
            .map_err(io_err("cannot read", archive))?
            .to_string_lossy()
            .into_owned();
        // unpack_in refuses names that would leave `dest` (`..`, absolute paths).
        entry
            .unpack_in(dest)
            .map_err(io_err("cannot unpack into", dest))?;
        names.push(name);
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn pack_then_unpack_gives_the_same_files_and_modes() {
        let dir = tempfile::tempdir().unwrap();
        let prog = dir.path().join("prog");
        // Two files sharing most bytes, as the CUDA binaries do.
        let body: Vec<u8> = (0..200_000u32)
            .flat_map(|i| (i * 7919).to_le_bytes())
            .collect();
        std::fs::write(&prog, &body).unwrap();
        std::fs::set_permissions(&prog, std::fs::Permissions::from_mode(0o755)).unwrap();
        let script = dir.path().join("other");
        let mut other = body.clone();
        other.extend_from_slice(b"#!/usr/bin/env python3\nprint('hi')\n");
        std::fs::write(&script, &other).unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o644)).unwrap();

        let archive = dir.path().join(ARCHIVE);
        let entries = [
            Entry {
                name: "prog".into(),
                source: prog.clone(),
            },
            Entry {
                name: "gloo.py".into(),
                source: script.clone(),
            },
        ];
        // The real settings: a 512 MiB dictionary.
        let raw = pack(&entries, &archive, DICT_SIZE).unwrap();
        assert_eq!(raw, (body.len() + other.len()) as u64);
        let packed = std::fs::metadata(&archive).unwrap().len();
        // The second file costs almost nothing next to the first.
        assert!(packed < body.len() as u64, "{packed} bytes packed");

        let out = dir.path().join("out");
        assert_eq!(unpack(&archive, &out).unwrap(), ["prog", "gloo.py"]);
        assert_eq!(std::fs::read(out.join("prog")).unwrap(), body);
        assert_eq!(std::fs::read(out.join("gloo.py")).unwrap(), other);
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&out.join("prog")), 0o755);
        assert_eq!(mode(&out.join("gloo.py")), 0o644);
        // Unpacking again over the same folder replaces the files.
        assert_eq!(unpack(&archive, &out).unwrap().len(), 2);
    }

    #[test]
    fn the_archive_is_xz_with_the_large_dictionary() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("f");
        std::fs::write(&f, b"small").unwrap();
        let archive = dir.path().join(ARCHIVE);
        pack(
            &[Entry {
                name: "f".into(),
                source: f,
            }],
            &archive,
            DICT_SIZE,
        )
        .unwrap();
        let bytes = std::fs::read(&archive).unwrap();
        assert_eq!(&bytes[..6], b"\xFD7zXZ\0", "xz magic");
        // Block header: size byte, flags, then the LZMA2 filter (id 0x21, 1 property byte);
        // the property byte p encodes the dictionary as (2 | p & 1) << (p / 2 + 11), so
        // 512 MiB = 2 << 28 is 34.
        let block = &bytes[12..];
        assert_eq!(
            &block[2..5],
            &[0x21, 0x01, 34],
            "LZMA2 with a 512 MiB dictionary"
        );
    }

    #[test]
    fn missing_files_and_archives_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let archive = dir.path().join(ARCHIVE);
        let err = pack(
            &[Entry {
                name: "x".into(),
                source: dir.path().join("missing"),
            }],
            &archive,
            1 << 20,
        )
        .unwrap_err();
        assert!(err.to_string().contains("missing"), "{err}");
        let err = unpack(&dir.path().join("nope.tar.xz"), &dir.path().join("o")).unwrap_err();
        assert!(err.to_string().starts_with("cannot open"), "{err}");
        std::fs::write(&archive, b"not xz").unwrap();
        assert!(unpack(&archive, &dir.path().join("o")).is_err());
    }
}
