//! Open MPI's key-value service, PMIx, through `libpmix` loaded at run time: rank 0 publishes
//! its store host, the others read it. The only foreign calls of the bootstrap's launcher
//! exchange are here.
//!
//! Open MPI (4.x) serves PMIx from its daemons; the client library is the one Open MPI itself
//! links (Debian: `libpmix.so.2`, from `libpmix2`, which `openmpi-bin` brings). It is opened with
//! `dlopen` when a job across hosts needs it, so that ferrocomm neither links it nor needs its
//! headers to build, and runs where it is absent (the caller then says to set `FERROCOMM_COORD`).
//!
//! The conversation: `PMIx_Init`; rank 0 `PMIx_Put(PMIX_GLOBAL, key, string)` and `PMIx_Commit`;
//! everyone `PMIx_Fence` over the job, collecting the data; `PMIx_Get` of rank 0's key;
//! `PMIx_Finalize`. The layouts below are those of PMIx's `pmix_common.h` (v3 and v4 alike),
//! checked against its compiled sizes: `pmix_proc_t` 260 bytes (namespace 256, rank at 256),
//! `pmix_value_t` 32 (type, then the union at 8), `pmix_info_t` 552 (key 512, flags at 512,
//! value at 520).

use std::ffi::{CStr, CString, c_char, c_void};

use libloading::Library;

/// Key under which rank 0 publishes its store host.
pub(crate) const STORE_KEY: &str = "ferrocomm.store";

/// The library names tried, in order: the soname Open MPI links, then the unversioned name.
const LIBRARIES: [&str; 3] = ["libpmix.so.2", "/usr/lib/x86_64-linux-gnu/pmix2/lib/libpmix.so.2", "libpmix.so"];

const PMIX_MAX_NSLEN: usize = 255;
const PMIX_MAX_KEYLEN: usize = 511;
const PMIX_SUCCESS: i32 = 0;
const PMIX_BOOL: u16 = 1;
const PMIX_STRING: u16 = 3;
const PMIX_GLOBAL: u8 = 3;
const PMIX_COLLECT_DATA: &[u8] = b"pmix.collect";

/// `pmix_proc_t`.
#[repr(C)]
struct Proc {
    nspace: [c_char; PMIX_MAX_NSLEN + 1],
    rank: u32,
}

/// `pmix_value_t`: a type tag and a 24-byte union, of which a `char *` string or a `bool` flag
/// (at the union's start) are used here.
#[repr(C)]
struct Value {
    kind: u16,
    data: [u64; 3],
}

/// `pmix_info_t`.
#[repr(C)]
struct Info {
    key: [c_char; PMIX_MAX_KEYLEN + 1],
    flags: u32,
    value: Value,
}

const _: () = assert!(size_of::<Proc>() == 260 && std::mem::offset_of!(Proc, rank) == 256);
const _: () = assert!(size_of::<Value>() == 32 && std::mem::offset_of!(Value, data) == 8);
const _: () = assert!(size_of::<Info>() == 552 && std::mem::offset_of!(Info, value) == 520);

type InitFn = unsafe extern "C" fn(*mut Proc, *mut Info, usize) -> i32;
type FinalizeFn = unsafe extern "C" fn(*const Info, usize) -> i32;
type PutFn = unsafe extern "C" fn(u8, *const c_char, *mut Value) -> i32;
type CommitFn = unsafe extern "C" fn() -> i32;
type FenceFn = unsafe extern "C" fn(*const Proc, usize, *const Info, usize) -> i32;
type GetFn = unsafe extern "C" fn(*const Proc, *const c_char, *const Info, usize, *mut *mut Value) -> i32;

/// Why the exchange did not happen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PmixError {
    /// `libpmix` (or one of its functions) cannot be loaded here.
    Unavailable(String),
    /// It was loaded, and a call failed or returned something unusable.
    Failed(String),
}

struct Api {
    init: InitFn,
    finalize: FinalizeFn,
    put: PutFn,
    commit: CommitFn,
    fence: FenceFn,
    get: GetFn,
}

fn load() -> Result<Api, PmixError> {
    load_from(&LIBRARIES)
}

/// Opens the first of `names` that loads and resolves the functions used.
fn load_from(names: &[&str]) -> Result<Api, PmixError> {
    let mut tried = Vec::new();
    let lib = names.iter().find_map(|name| {
        // SAFETY: loading libpmix runs its initialisers, which only set up its own state.
        match unsafe { Library::new(name) } {
            Ok(lib) => Some(lib),
            Err(e) => {
                tried.push(format!("{name}: {e}"));
                None
            }
        }
    });
    let Some(lib) = lib else { return Err(PmixError::Unavailable(tried.join("; "))) };
    // Never unloaded: after PMIx_Finalize the library may still hold handlers and threads.
    let lib: &'static Library = Box::leak(Box::new(lib));
    macro_rules! sym {
        ($name:literal, $ty:ty) => {
            // SAFETY: the symbol is the PMIx function of that name, whose C signature `$ty`
            // spells (pmix.h).
            *unsafe { lib.get::<$ty>(concat!($name, "\0").as_bytes()) }
                .map_err(|e| PmixError::Unavailable(format!("{}: {e}", $name)))?
        };
    }
    Ok(Api {
        init: sym!("PMIx_Init", InitFn),
        finalize: sym!("PMIx_Finalize", FinalizeFn),
        put: sym!("PMIx_Put", PutFn),
        commit: sym!("PMIx_Commit", CommitFn),
        fence: sym!("PMIx_Fence", FenceFn),
        get: sym!("PMIx_Get", GetFn),
    })
}

fn check(what: &str, status: i32) -> Result<(), PmixError> {
    if status == PMIX_SUCCESS { Ok(()) } else { Err(PmixError::Failed(format!("{what} returned status {status}"))) }
}

/// Runs the conversation: rank 0 passes `Some(host)` to publish, the others `None`. Returns rank
/// 0's host as every rank read it back.
pub(crate) fn exchange(publish: Option<&str>) -> Result<String, PmixError> {
    let api = load()?;
    // SAFETY: `Proc` is plain data; all zeroes is a valid (empty) value.
    let mut me: Proc = unsafe { std::mem::zeroed() };
    // SAFETY: PMIx_Init writes this process's namespace and rank into `me`, which outlives the
    // call; no attributes are passed (null, 0).
    check("PMIx_Init", unsafe { (api.init)(&mut me, std::ptr::null_mut(), 0) })?;
    let result = conversation(&api, &me, publish);
    // SAFETY: PMIx was initialised above; no attributes are passed.
    let finalized = check("PMIx_Finalize", unsafe { (api.finalize)(std::ptr::null(), 0) });
    let host = result?;
    finalized?;
    Ok(host)
}

fn conversation(api: &Api, me: &Proc, publish: Option<&str>) -> Result<String, PmixError> {
    let key = CString::new(STORE_KEY).map_err(|e| PmixError::Failed(e.to_string()))?;
    if let Some(host) = publish {
        let host = CString::new(host).map_err(|e| PmixError::Failed(format!("the host {host:?}: {e}")))?;
        let mut value = Value { kind: PMIX_STRING, data: [host.as_ptr() as u64, 0, 0] };
        // SAFETY: `key` and `host` are NUL-terminated and outlive the call; PMIx_Put copies the
        // value (and its string) before returning.
        check("PMIx_Put", unsafe { (api.put)(PMIX_GLOBAL, key.as_ptr(), &mut value) })?;
        // SAFETY: no arguments; PMIx is initialised.
        check("PMIx_Commit", unsafe { (api.commit)() })?;
    }
    // A fence over this job (no processes named: all of this namespace), collecting what was
    // put so that the get below is answered locally.
    // SAFETY: `Info` is plain data; all zeroes is a valid (empty) value.
    let mut collect: Info = unsafe { std::mem::zeroed() };
    for (d, s) in collect.key.iter_mut().zip(PMIX_COLLECT_DATA) {
        *d = *s as c_char;
    }
    collect.value.kind = PMIX_BOOL;
    collect.value.data[0] = 1; // `bool flag` = true, in the union's first byte.
    // SAFETY: `collect` is one valid pmix_info_t that outlives the call; no processes are named.
    check("PMIx_Fence", unsafe { (api.fence)(std::ptr::null(), 0, &collect, 1) })?;

    let rank0 = Proc { nspace: me.nspace, rank: 0 };
    let mut out: *mut Value = std::ptr::null_mut();
    // SAFETY: `rank0` and `key` outlive the call; on success PMIx_Get stores a value it
    // allocated with malloc into `out`.
    check("PMIx_Get of rank 0's key", unsafe { (api.get)(&rank0, key.as_ptr(), std::ptr::null(), 0, &mut out) })?;
    if out.is_null() {
        return Err(PmixError::Failed("PMIx_Get returned no value".into()));
    }
    // SAFETY: `out` is the non-null pmix_value_t PMIx_Get returned; for PMIX_STRING its union
    // holds a malloc'd NUL-terminated string (or null). Both are freed once read; PMIx allocates
    // them with the C library's malloc.
    let host = unsafe {
        let value = &*out;
        let string = value.data[0] as *mut c_char;
        let host = if value.kind == PMIX_STRING && !string.is_null() {
            Ok(CStr::from_ptr(string).to_string_lossy().into_owned())
        } else {
            Err(PmixError::Failed(format!("rank 0's value has PMIx type {}, not a string", value.kind)))
        };
        if value.kind == PMIX_STRING && !string.is_null() {
            libc::free(string.cast::<c_void>());
        }
        libc::free(out.cast::<c_void>());
        host?
    };
    Ok(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_library_that_cannot_be_loaded_is_unavailable() {
        let Err(PmixError::Unavailable(why)) = load_from(&["libferrocomm-no-such-pmix.so.9"]) else {
            panic!("a missing library must be Unavailable")
        };
        assert!(why.contains("libferrocomm-no-such-pmix.so.9"), "{why}");
        // A library without PMIx's functions (the C library) is unavailable too, not a crash.
        let Err(PmixError::Unavailable(why)) = load_from(&["libc.so.6"]) else {
            panic!("a library without PMIx_Init must be Unavailable")
        };
        assert!(why.contains("PMIx_Init"), "{why}");
    }
}
