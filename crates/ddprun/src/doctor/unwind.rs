//! Unwinding and naming a stopped thread's stack: the process's executable mappings
//! (`/proc/PID/maps`), each module's call-frame rules (`.eh_frame`, evaluated by gimli) and
//! its names (line tables and symbols, through addr2line). Modules are parsed once per file
//! and kept; their names are read only after the thread was let go.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use gimli::{
    BaseAddresses, CfaRule, EhFrame, EhFrameHdr, LittleEndian, RegisterRule, UnwindContext,
    UnwindSection, X86_64,
};
use object::{Object, ObjectSection, ObjectSegment};

/// The most frames taken.
const MAX_FRAMES: usize = 64;

/// The registers an unwind step needs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Regs {
    /// The instruction pointer.
    pub ip: u64,
    /// The stack pointer.
    pub sp: u64,
    /// The frame pointer.
    pub bp: u64,
}

/// An executable mapping of a file.
struct Mapping {
    start: u64,
    end: u64,
    path: PathBuf,
    /// Where the file's first loaded page is in the process.
    base: u64,
}

/// A process's executable mappings.
pub(crate) struct Maps(Vec<Mapping>);

impl Maps {
    /// The executable mappings of process `pid`.
    pub fn read(pid: u32) -> Result<Maps, String> {
        let path = format!("/proc/{pid}/maps");
        let text = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
        let mut lowest: HashMap<String, u64> = HashMap::new();
        let mut exec = Vec::new();
        for line in text.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 6 || !f[5].starts_with('/') {
                continue;
            }
            let Some((start, end)) = f[0].split_once('-') else {
                continue;
            };
            let (Ok(start), Ok(end)) =
                (u64::from_str_radix(start, 16), u64::from_str_radix(end, 16))
            else {
                continue;
            };
            let file = f[5..].join(" ");
            if u64::from_str_radix(f[2], 16) == Ok(0) {
                let low = lowest.entry(file.clone()).or_insert(start);
                *low = (*low).min(start);
            }
            if f[1].contains('x') {
                exec.push((start, end, file));
            }
        }
        let maps = exec
            .into_iter()
            .filter_map(|(start, end, file)| {
                let base = *lowest.get(&file)?;
                Some(Mapping {
                    start,
                    end,
                    path: PathBuf::from(file),
                    base,
                })
            })
            .collect();
        Ok(Maps(maps))
    }

    fn find(&self, pc: u64) -> Option<&Mapping> {
        self.0.iter().find(|m| m.start <= pc && pc < m.end)
    }
}

/// A module's file, mapped, with its unwind sections' addresses; its names loaded on demand.
struct Module {
    data: memmap2::Mmap,
    path: PathBuf,
    /// The file's first loaded address (page-aligned): what `Mapping::base` maps.
    first_load: u64,
    eh_frame: Option<(u64, std::ops::Range<usize>)>,
    eh_frame_hdr: Option<(u64, std::ops::Range<usize>)>,
    text: u64,
    names: Option<Option<addr2line::Loader>>,
}

/// The modules parsed so far, by file.
#[derive(Default)]
pub(crate) struct Modules(HashMap<PathBuf, Option<Module>>);

impl Modules {
    fn get(&mut self, path: &Path) -> Option<&mut Module> {
        self.0
            .entry(path.to_path_buf())
            .or_insert_with(|| Module::open(path))
            .as_mut()
    }

    /// The module address (in the file's own addresses) of process address `pc`.
    fn locate(&mut self, maps: &Maps, pc: u64) -> Option<(&mut Module, u64)> {
        let m = maps.find(pc)?;
        let offset = pc.checked_sub(m.base)?;
        let module = self.get(&m.path)?;
        let svma = offset.checked_add(module.first_load)?;
        Some((module, svma))
    }

    /// The return addresses from `regs`, innermost first, memory read through `read`.
    pub fn unwind(
        &mut self,
        maps: &Maps,
        regs: Regs,
        read: &dyn Fn(u64) -> Option<u64>,
    ) -> Vec<u64> {
        let mut regs = regs;
        let mut pcs = vec![regs.ip];
        while pcs.len() < MAX_FRAMES {
            // The caller's call instruction, not the one after it (except the innermost).
            let lookup = if pcs.len() == 1 {
                regs.ip
            } else {
                regs.ip.saturating_sub(1)
            };
            let Some((module, svma)) = self.locate(maps, lookup) else {
                break;
            };
            match module.caller(svma, &regs, read) {
                Some(next) if next.ip != 0 && next.sp > regs.sp => {
                    regs = next;
                    pcs.push(regs.ip);
                }
                _ => break,
            }
        }
        pcs
    }

    /// The frames at the return addresses `pcs` (inlined ones first), each
    /// `function (file:line)`.
    pub fn names(&mut self, maps: &Maps, pcs: &[u64]) -> Vec<String> {
        pcs.iter()
            .enumerate()
            .flat_map(|(i, &pc)| self.name(maps, if i == 0 { pc } else { pc.saturating_sub(1) }))
            .collect()
    }

    fn name(&mut self, maps: &Maps, pc: u64) -> Vec<String> {
        let file_name = |p: &Path| {
            p.file_name()
                .map_or_else(String::new, |f| f.to_string_lossy().into_owned())
        };
        let Some(mapping_path) = maps.find(pc).map(|m| m.path.clone()) else {
            return vec![format!("?? ({pc:#x})")];
        };
        let Some((module, svma)) = self.locate(maps, pc) else {
            return vec![format!("?? ({})", file_name(&mapping_path))];
        };
        let mut out = Vec::new();
        if let Some(names) = module.names() {
            if let Ok(mut frames) = names.find_frames(svma) {
                while let Ok(Some(frame)) = frames.next() {
                    let function = frame
                        .function
                        .as_ref()
                        .and_then(|f| f.demangle().ok().map(|d| d.into_owned()));
                    let Some(function) = function else { continue };
                    out.push(with_location(
                        strip_hash(&function),
                        frame.location.as_ref(),
                    ));
                }
            }
            if out.is_empty()
                && let Some(sym) = names.find_symbol(svma)
            {
                let name = format!("{:#}", rustc_demangle::demangle(sym));
                let location = names.find_location(svma).ok().flatten();
                out.push(with_location(name, location.as_ref()));
            }
        }
        if out.is_empty() {
            out.push(format!("?? ({})", file_name(&mapping_path)));
        }
        out
    }
}

fn strip_hash(name: &str) -> String {
    match name.rsplit_once("::h") {
        Some((head, hash)) if hash.len() == 16 && hash.chars().all(|c| c.is_ascii_hexdigit()) => {
            head.to_string()
        }
        _ => name.to_string(),
    }
}

fn with_location(function: String, location: Option<&addr2line::Location<'_>>) -> String {
    match location.and_then(|l| Some((l.file?, l.line?))) {
        Some((file, line)) => format!("{function} ({}:{line})", short_path(file)),
        None => function,
    }
}

/// A source path as a verdict shows it: the toolchain's under `<rust>/`, a registry crate's
/// under `<cargo>/` (both are skipped when the verdict names the program's own frames), the
/// program's own from its `src/`.
fn short_path(file: &str) -> String {
    if let Some(i) = file
        .find("/library/")
        .filter(|_| file.starts_with("/rustc/"))
    {
        return format!("<rust>{}", &file[i..]);
    }
    if let Some(i) = file.find("/registry/src/") {
        let rest = &file[i + "/registry/src/".len()..];
        let crate_path = rest.split_once('/').map_or(rest, |(_, p)| p);
        return format!("<cargo>/{crate_path}");
    }
    match file.rfind("/src/") {
        Some(i) => file[i + 1..].to_string(),
        None => file.to_string(),
    }
}

impl Module {
    fn open(path: &Path) -> Option<Module> {
        let file = std::fs::File::open(path).ok()?;
        // SAFETY: the mapping is read-only and only read as bytes. A file truncated while it is
        // mapped would raise SIGBUS on a read past its new end: a rank's program and libraries
        // are not rewritten in place while it runs (an upgrade replaces the file).
        let data = unsafe { memmap2::Mmap::map(&file) }.ok()?;
        let obj = object::File::parse(&*data).ok()?;
        let first_load = obj.segments().map(|s| s.address()).min().unwrap_or(0) & !0xfff;
        let range = |name: &str| {
            let s = obj.section_by_name(name)?;
            let (off, len) = s.file_range()?;
            Some((
                s.address(),
                usize::try_from(off).ok()?..usize::try_from(off + len).ok()?,
            ))
        };
        let text = obj.section_by_name(".text").map_or(0, |s| s.address());
        Some(Module {
            eh_frame: range(".eh_frame"),
            eh_frame_hdr: range(".eh_frame_hdr"),
            text,
            first_load,
            names: None,
            path: path.to_path_buf(),
            data,
        })
    }

    /// The names (line tables, symbols), loaded the first time they are asked for.
    fn names(&mut self) -> Option<&addr2line::Loader> {
        let path = &self.path;
        self.names
            .get_or_insert_with(|| addr2line::Loader::new(path).ok())
            .as_ref()
    }

    /// The caller's registers of the frame at module address `svma` with `regs`, memory read
    /// through `read`.
    fn caller(&self, svma: u64, regs: &Regs, read: &dyn Fn(u64) -> Option<u64>) -> Option<Regs> {
        let (eh_addr, eh_range) = self.eh_frame.clone()?;
        let eh_frame = EhFrame::new(self.data.get(eh_range)?, LittleEndian);
        let mut bases = BaseAddresses::default()
            .set_eh_frame(eh_addr)
            .set_text(self.text);
        let mut ctx = UnwindContext::new();
        let row = match self.eh_frame_hdr.clone() {
            Some((hdr_addr, hdr_range)) => {
                bases = bases.set_eh_frame_hdr(hdr_addr);
                let hdr = EhFrameHdr::new(self.data.get(hdr_range)?, LittleEndian)
                    .parse(&bases, 8)
                    .ok()?;
                hdr.table()?
                    .unwind_info_for_address(
                        &eh_frame,
                        &bases,
                        &mut ctx,
                        svma,
                        EhFrame::cie_from_offset,
                    )
                    .ok()?
                    .clone()
            }
            None => eh_frame
                .unwind_info_for_address(&bases, &mut ctx, svma, EhFrame::cie_from_offset)
                .ok()?
                .clone(),
        };
        let cfa = match row.cfa() {
            CfaRule::RegisterAndOffset { register, offset } => {
                let base = match *register {
                    X86_64::RSP => regs.sp,
                    X86_64::RBP => regs.bp,
                    _ => return None,
                };
                base.checked_add_signed(*offset)?
            }
            CfaRule::Expression(_) => return None,
        };
        let ra = match row.register(X86_64::RA) {
            Some(RegisterRule::Offset(o)) => read(cfa.checked_add_signed(o)?)?,
            _ => return None,
        };
        let bp = match row.register(X86_64::RBP) {
            Some(RegisterRule::Offset(o)) => read(cfa.checked_add_signed(o)?)?,
            _ => regs.bp,
        };
        Some(Regs {
            ip: ra,
            sp: cfa,
            bp,
        })
    }
}
