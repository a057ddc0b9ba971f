//! The main thread's stack of a rank, taken by its launcher (a parent may trace its child):
//! `PTRACE_SEIZE` and `PTRACE_INTERRUPT` stop the thread for a moment, its registers and
//! stack are read, `PTRACE_DETACH` lets it go on; the frames are unwound with the modules'
//! `.eh_frame` call-frame rules (gimli) and named from their line tables and symbols
//! (addr2line). A stopped rank is never traced (it would not answer); a rank that cannot be
//! traced (a container forbidding ptrace) gives the reason instead of a stack.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gimli::{
    BaseAddresses, CfaRule, EhFrame, EhFrameHdr, LittleEndian, RegisterRule, UnwindContext,
    UnwindSection, X86_64,
};
use object::{Object, ObjectSection, ObjectSegment};

/// The most frames taken.
const MAX_FRAMES: usize = 64;
/// How long the thread may take to stop.
const STOP_WAIT: Duration = Duration::from_secs(2);

/// The stack of process `pid`'s main thread, innermost frame first (`function (file:line)`).
pub(crate) fn main_thread(pid: u32) -> Result<Vec<String>, String> {
    if !cfg!(all(target_os = "linux", target_arch = "x86_64")) {
        return Err("stacks are taken on x86-64 Linux only".into());
    }
    let maps = Maps::read(pid)?;
    let mut modules = Modules::default();
    let pcs = {
        let traced = Traced::stop(pid)?;
        traced.unwind(&maps, &mut modules)
    };
    Ok(pcs
        .iter()
        .enumerate()
        .flat_map(|(i, &pc)| modules.name(&maps, if i == 0 { pc } else { pc - 1 }))
        .collect())
}

/// An executable mapping of a file.
struct Mapping {
    start: u64,
    end: u64,
    path: PathBuf,
    /// Where the file's address 0 is in the process.
    bias: u64,
}

/// The process's executable mappings.
struct Maps(Vec<Mapping>);

impl Maps {
    fn read(pid: u32) -> Result<Maps, String> {
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
            let offset = u64::from_str_radix(f[2], 16).unwrap_or(u64::MAX);
            let file = f[5..].join(" ");
            if offset == 0 {
                let low = lowest.entry(file.clone()).or_insert(start);
                *low = (*low).min(start);
            }
            if f[1].contains('x') {
                exec.push((start, end, file));
            }
        }
        let mut maps = Vec::new();
        for (start, end, file) in exec {
            let Some(&base) = lowest.get(&file) else {
                continue;
            };
            maps.push(Mapping {
                start,
                end,
                path: PathBuf::from(file),
                bias: base,
            });
        }
        Ok(Maps(maps))
    }

    fn find(&self, pc: u64) -> Option<&Mapping> {
        self.0.iter().find(|m| m.start <= pc && pc < m.end)
    }
}

/// A module's file, mapped, with its unwind sections' addresses, and its symboliser.
struct Module {
    data: memmap2::Mmap,
    /// The file's first loaded address (the bias is measured from it).
    first_load: u64,
    eh_frame: Option<(u64, std::ops::Range<usize>)>,
    eh_frame_hdr: Option<(u64, std::ops::Range<usize>)>,
    text: u64,
    names: Option<addr2line::Loader>,
}

#[derive(Default)]
struct Modules(HashMap<PathBuf, Option<Module>>);

impl Modules {
    fn get(&mut self, path: &Path) -> Option<&Module> {
        self.0
            .entry(path.to_path_buf())
            .or_insert_with(|| Module::open(path))
            .as_ref()
    }

    /// The frames at `pc` (inlined ones first), each `function (file:line)`.
    fn name(&mut self, maps: &Maps, pc: u64) -> Vec<String> {
        let Some(m) = maps.find(pc) else {
            return vec![format!("?? ({pc:#x})")];
        };
        let Some(module) = self.get(&m.path) else {
            return vec![format!("?? ({})", m.path.display())];
        };
        let svma = pc - m.bias + module.first_load;
        let mut out = Vec::new();
        if let Some(names) = &module.names {
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
            let file = m
                .path
                .file_name()
                .map_or_else(String::new, |f| f.to_string_lossy().into_owned());
            out.push(format!("?? ({file})"));
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
        // SAFETY: the mapping is read-only; a file changed underneath gives wrong names, not
        // undefined behaviour in this process beyond what reading it would.
        let data = unsafe { memmap2::Mmap::map(&file) }.ok()?;
        let obj = object::File::parse(&*data).ok()?;
        let first_load = obj.segments().map(|s| s.address()).min().unwrap_or(0) & !0xfff;
        let range = |name: &str| {
            let s = obj.section_by_name(name)?;
            let (off, len) = s.file_range()?;
            Some((s.address(), off as usize..(off + len) as usize))
        };
        let text = obj.section_by_name(".text").map_or(0, |s| s.address());
        Some(Module {
            eh_frame: range(".eh_frame"),
            eh_frame_hdr: range(".eh_frame_hdr"),
            text,
            first_load,
            names: addr2line::Loader::new(path).ok(),
            data,
        })
    }

    /// The return address and caller's registers of the frame at `svma` with `regs`, its
    /// memory read through `read`.
    fn caller(
        &self,
        svma: u64,
        bias: u64,
        regs: &Regs,
        read: &dyn Fn(u64) -> Option<u64>,
    ) -> Option<Regs> {
        let (eh_addr, eh_range) = self.eh_frame.clone()?;
        let eh_frame = EhFrame::new(&self.data[eh_range], LittleEndian);
        let mut bases = BaseAddresses::default()
            .set_eh_frame(eh_addr)
            .set_text(self.text);
        let mut ctx = UnwindContext::new();
        let row = match self.eh_frame_hdr.clone() {
            Some((hdr_addr, hdr_range)) => {
                bases = bases.set_eh_frame_hdr(hdr_addr);
                let hdr = EhFrameHdr::new(&self.data[hdr_range], LittleEndian)
                    .parse(&bases, 8)
                    .ok()?;
                let table = hdr.table()?;
                table
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
        let _ = bias;
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

#[derive(Debug, Clone, Copy)]
struct Regs {
    ip: u64,
    sp: u64,
    bp: u64,
}

/// A thread held in a ptrace stop; let go when dropped.
struct Traced {
    pid: libc::pid_t,
    regs: Regs,
}

impl Traced {
    fn stop(pid: u32) -> Result<Traced, String> {
        let pid = libc::pid_t::try_from(pid).map_err(|_| "no such process".to_string())?;
        let os = |what: &str| format!("{what}: {}", std::io::Error::last_os_error());
        // SAFETY: ptrace requests on our own child with no pointers passed.
        if unsafe { libc::ptrace(libc::PTRACE_SEIZE, pid, 0, 0) } != 0 {
            return Err(os("cannot trace the rank (PTRACE_SEIZE)"));
        }
        let mut traced = Traced {
            pid,
            regs: Regs {
                ip: 0,
                sp: 0,
                bp: 0,
            },
        };
        // SAFETY: as above.
        if unsafe { libc::ptrace(libc::PTRACE_INTERRUPT, pid, 0, 0) } != 0 {
            return Err(os("cannot stop the rank (PTRACE_INTERRUPT)"));
        }
        traced.wait_for_stop()?;
        // SAFETY: `regs` is a plain struct PTRACE_GETREGS fills.
        let mut regs: libc::user_regs_struct = unsafe { std::mem::zeroed() };
        if unsafe { libc::ptrace(libc::PTRACE_GETREGS, pid, 0, &mut regs as *mut _) } != 0 {
            return Err(os("cannot read the rank's registers (PTRACE_GETREGS)"));
        }
        traced.regs = Regs {
            ip: regs.rip,
            sp: regs.rsp,
            bp: regs.rbp,
        };
        Ok(traced)
    }

    /// Waits for the ptrace stop, peeking first (`WNOWAIT`) so that an exit is left for the
    /// watch loop to reap, not swallowed here.
    fn wait_for_stop(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + STOP_WAIT;
        loop {
            // SAFETY: waitid fills `info`; no other memory is touched.
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            let r = unsafe {
                libc::waitid(
                    libc::P_PID,
                    self.pid as libc::id_t,
                    &mut info,
                    libc::WSTOPPED | libc::WEXITED | libc::WNOHANG | libc::WNOWAIT | libc::__WALL,
                )
            };
            if r != 0 {
                return Err(format!(
                    "waiting for the rank to stop: {}",
                    std::io::Error::last_os_error()
                ));
            }
            // SAFETY: si_pid is valid for SIGCHLD infos waitid returns.
            let who = unsafe { info.si_pid() };
            if who == self.pid {
                if matches!(
                    info.si_code,
                    libc::CLD_EXITED | libc::CLD_KILLED | libc::CLD_DUMPED
                ) {
                    return Err("the rank exited".into());
                }
                // A stop: consume it.
                let mut status = 0;
                // SAFETY: as above.
                unsafe { libc::waitpid(self.pid, &mut status, libc::WNOHANG | libc::__WALL) };
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "the rank did not stop within {STOP_WAIT:?} (uninterruptible?)"
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn read(&self, addr: u64) -> Option<u64> {
        let mut word = [0u8; 8];
        let local = libc::iovec {
            iov_base: word.as_mut_ptr().cast(),
            iov_len: 8,
        };
        let remote = libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: 8,
        };
        // SAFETY: reads 8 bytes of the stopped child into `word`.
        let n = unsafe { libc::process_vm_readv(self.pid, &local, 1, &remote, 1, 0) };
        (n == 8).then(|| u64::from_le_bytes(word))
    }

    /// The return addresses from the stopped thread's registers, innermost first.
    fn unwind(&self, maps: &Maps, modules: &mut Modules) -> Vec<u64> {
        let mut regs = self.regs;
        let mut pcs = vec![regs.ip];
        let read = |a| self.read(a);
        while pcs.len() < MAX_FRAMES {
            // The caller's call instruction, not the one after it (except the innermost).
            let lookup = if pcs.len() == 1 { regs.ip } else { regs.ip - 1 };
            let Some(m) = maps.find(lookup) else { break };
            let bias = m.bias;
            let Some(module) = modules.get(&m.path) else {
                break;
            };
            let svma = lookup - bias + module.first_load;
            match module.caller(svma, bias, &regs, &read) {
                Some(next) if next.ip != 0 && next.sp > regs.sp => {
                    regs = next;
                    pcs.push(regs.ip);
                }
                _ => break,
            }
        }
        pcs
    }
}

impl Drop for Traced {
    fn drop(&mut self) {
        // SAFETY: ptrace on our own tracee.
        unsafe { libc::ptrace(libc::PTRACE_DETACH, self.pid, 0, 0) };
    }
}
