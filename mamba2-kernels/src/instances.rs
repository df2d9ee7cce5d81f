// The kernels of every `.cu` file, one list for both sides of the FFI: build.rs writes each
// file's instantiations from `instances()` (`OUT_DIR/<family>/<file>.inc`, included at the end of
// the `.cu`), and the launchers name a kernel only through the functions below, so a kernel's name
// is spelt in one place. The families' `plan` tests check that every kernel a launch plan can pick
// is in the list. build.rs includes this file too: plain Rust, no dependencies, no inner
// attributes.

/// A value or state type of the kernels: its suffix in kernel names and its C type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ty {
    F32,
    F16,
    Bf16,
}

impl Ty {
    pub const fn name(self) -> &'static str {
        match self {
            Ty::F32 => "f32",
            Ty::F16 => "f16",
            Ty::Bf16 => "bf16",
        }
    }

    pub const fn c(self) -> &'static str {
        match self {
            Ty::F32 => "float",
            Ty::F16 => "__half",
            Ty::Bf16 => "__nv_bfloat16",
        }
    }

    pub const fn bytes(self) -> usize {
        match self {
            Ty::F32 => 4,
            Ty::F16 | Ty::Bf16 => 2,
        }
    }
}

/// Types of values (x, b, c, z, y, conv and norm inputs).
pub const VALUES: [Ty; 3] = [Ty::F32, Ty::F16, Ty::Bf16];
/// Types of values the tensor-core kernels take.
pub const MMA_VALUES: [Ty; 2] = [Ty::F16, Ty::Bf16];
/// Types of SSD states (chunk states, decode state).
pub const STATES: [Ty; 2] = [Ty::F32, Ty::Bf16];

/// Warps per chunk_state_mma program (16 state rows each) and its state-column tiles.
pub const CHUNK_STATE_WARPS: [usize; 2] = [2, 4];
pub const CHUNK_STATE_TILES: [usize; 4] = [16, 32, 64, 128];
/// compute_out_mma's (N, channels per unit) pairs.
pub const COMPUTE_OUT_TILES: [(usize, usize); 9] = [
    (16, 32),
    (16, 64),
    (32, 32),
    (32, 64),
    (64, 32),
    (64, 64),
    (128, 32),
    (128, 64),
    (256, 32),
];
/// The (P, N) that bwd_compute_out has kernels for with both fixed at compile time.
pub const BWD_COMPUTE_OUT_FIXED: [(usize, usize); 3] = [(64, 64), (64, 128), (64, 256)];
/// compute_out_mma's tensor-map forms read the states as values: value type = state type.
pub const COMPUTE_OUT_TMA_VALUES: [Ty; 1] = [Ty::Bf16];
/// matvec's (rows, columns) per program.
pub const MATVEC_TILES: [(usize, usize); 6] = [(1, 8), (1, 2), (2, 8), (2, 2), (4, 4), (8, 2)];

/// How chunk_state_mma gets its inputs: step sizes given (plain) or stage 1 run inside (`_cs`),
/// tiles by cp.async (plain) or by tensor map (`_tma`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ChunkStateForm {
    Plain,
    Cs,
    Tma,
    TmaCs,
}

impl ChunkStateForm {
    pub const ALL: [ChunkStateForm; 4] = [Self::Plain, Self::Cs, Self::Tma, Self::TmaCs];

    const fn infix(self) -> &'static str {
        match self {
            Self::Plain => "",
            Self::Cs => "_cs",
            Self::Tma => "_tma",
            Self::TmaCs => "_tma_cs",
        }
    }

    const fn mac(self) -> &'static str {
        match self {
            Self::Plain => "CHUNK_STATE",
            Self::Cs => "CHUNK_STATE_CS",
            Self::Tma => "CHUNK_STATE_TMA",
            Self::TmaCs => "CHUNK_STATE_TMA_CS",
        }
    }
}

/// The decode step's state-row kernels: 4 columns per lane for N ≤ 128 (`Vec1`) or ≤ 256
/// (`Vec2`), or one column at a time (`Scalar`, any N and alignment).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StepPath {
    Vec1,
    Vec2,
    Scalar,
}

impl StepPath {
    pub const ALL: [StepPath; 3] = [Self::Vec1, Self::Vec2, Self::Scalar];

    const fn name(self) -> &'static str {
        match self {
            Self::Vec1 => "vec1",
            Self::Vec2 => "vec2",
            Self::Scalar => "scalar",
        }
    }
}

/// How a norm program holds its row: 8 consecutive values per thread with 16-byte accesses
/// (`Vec`), 8 strided values per thread (`Reg`), or re-read in a loop (`Loop`, any length).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RowKind {
    Vec,
    Reg,
    Loop,
}

impl RowKind {
    pub const ALL: [RowKind; 3] = [Self::Vec, Self::Reg, Self::Loop];

    const fn name(self) -> &'static str {
        match self {
            Self::Vec => "vec",
            Self::Reg => "reg",
            Self::Loop => "loop",
        }
    }
}

/// How the conv backward holds a channel's taps and its windows of inputs and gradients: in
/// registers for widths up to 4 (`K4`) or 8 (`K8`), or read from memory (`Any`, any width).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConvTaps {
    K4,
    K8,
    Any,
}

impl ConvTaps {
    pub const ALL: [ConvTaps; 3] = [Self::K4, Self::K8, Self::Any];

    const fn name(self) -> &'static str {
        match self {
            Self::K4 => "k4",
            Self::K8 => "k8",
            Self::Any => "any",
        }
    }

    /// The register window (the kernel's `W`; 0: none).
    pub const fn window(self) -> usize {
        match self {
            Self::K4 => 4,
            Self::K8 => 8,
            Self::Any => 0,
        }
    }
}

pub fn chunk_cumsum(t: Ty) -> String {
    format!("chunk_cumsum_{}", t.name())
}

pub fn fwd_pass_state_simt(t: Ty, s: Ty) -> String {
    format!("fwd_pass_state_simt_{}_{}", t.name(), s.name())
}

pub fn chunk_state_mma(
    form: ChunkStateForm,
    packed: bool,
    t: Ty,
    s: Ty,
    warps: usize,
    nt: usize,
) -> String {
    let (tn, sn, f) = (t.name(), s.name(), form.infix());
    let p = if packed { "_packed" } else { "" };
    format!("chunk_state_mma{f}{p}_{tn}_{sn}_w{warps}_n{nt}")
}

/// The scan across chunks; `deep`: a ring of 256 bytes of chunks per thread instead of 128;
/// `packed`: the form for packed sequences' rows.
pub fn state_scan(deep: bool, packed: bool, s: Ty) -> String {
    let (d, p) = (
        if deep { "_deep" } else { "" },
        if packed { "_packed" } else { "" },
    );
    format!("state_scan{d}{p}_{}", s.name())
}

/// The forms of the kernels that run packed sequences' chunks (`SsdParams::chunk_starts`) and
/// those that run a row's chunks of equal length.
const PACKED: [bool; 2] = [false, true];

/// A kernel macro's bool argument.
fn flag(b: bool) -> &'static str {
    if b {
        "true"
    } else {
        "false"
    }
}

/// compute_out on tensor cores: tiles by cp.async with states of type `s`, or by tensor map
/// (`tma`, states of the value type); `packed`: the form for the chunks of packed sequences.
pub fn compute_out_mma(tma: bool, packed: bool, t: Ty, s: Ty, n: usize, pt: usize) -> String {
    let p = if packed { "_packed" } else { "" };
    if tma {
        format!("compute_out_mma_tma{p}_{}_n{n}_p{pt}", t.name())
    } else {
        format!("compute_out_mma{p}_{}_{}_n{n}_p{pt}", t.name(), s.name())
    }
}

pub fn compute_out_simt(t: Ty, s: Ty) -> String {
    format!("compute_out_simt_{}_{}", t.name(), s.name())
}

/// The backward of stage 1: processed-dt gradients to raw dt and dt_bias.
pub fn bwd_chunk_cumsum(t: Ty) -> String {
    format!("bwd_chunk_cumsum_{}", t.name())
}

/// The backward state pass: every chunk's own state gradient, then the scan across chunks.
pub fn bwd_chunk_state(t: Ty, s: Ty) -> String {
    format!("bwd_chunk_state_{}_{}", t.name(), s.name())
}

pub fn bwd_state_scan(wide: bool, s: Ty) -> String {
    format!(
        "bwd_state_scan{}_{}",
        if wide { "_v8" } else { "" },
        s.name()
    )
}

/// The backward of compute_out: each chunk's gradients of x, B, C, dt, a and D; `fixed`: its
/// (P, N), one of [`BWD_COMPUTE_OUT_FIXED`], compiled in (the tensor-core value types only), else
/// read at run time.
pub fn bwd_compute_out(t: Ty, s: Ty, fixed: Option<(usize, usize)>) -> String {
    match fixed {
        Some((p, n)) => format!("bwd_compute_out_{}_{}_p{p}_n{n}", t.name(), s.name()),
        None => format!("bwd_compute_out_{}_{}", t.name(), s.name()),
    }
}

/// bwd_compute_out's wgmma form with its tiles copied by tensor map (the states too where `s` is
/// bf16): bf16 values, P = 64 and `n`, one of [`BWD_COMPUTE_OUT_FIXED`]'s N, compiled in (sm_90a);
/// `bc` false: without dB and dC, which bwd_bc forms.
pub fn bwd_compute_out_tma(s: Ty, n: usize, bc: bool) -> String {
    let rest = if bc { "" } else { "_no_bc" };
    format!("bwd_compute_out_tma_bf16_{}_p64_n{n}{rest}", s.name())
}

/// The N that bwd_bc has kernels for (P = 64, bf16 values, chunks of 128 tokens).
pub const BWD_BC_DSTATES: [usize; 2] = [128, 256];

/// dB and dC summed over each group's heads in one program (sm_90a): bf16 values, states of
/// type `s`, P = 64 and `n`, one of [`BWD_BC_DSTATES`], compiled in.
pub fn bwd_bc(s: Ty, n: usize) -> String {
    format!("bwd_bc_bf16_{}_p64_n{n}", s.name())
}

/// dB's and dC's f32 sums rounded to the 16-bit value type `t`, after bwd_compute_out.
pub fn bwd_compute_out_round(t: Ty) -> String {
    format!("bwd_compute_out_round_{}", t.name())
}

pub fn ssd_step(t: Ty, s: Ty, path: StepPath) -> String {
    format!("ssd_step_{}_{}_{}", t.name(), s.name(), path.name())
}

pub fn causal_conv1d(t: Ty) -> String {
    format!("causal_conv1d_{}", t.name())
}

pub fn causal_conv1d_step(t: Ty) -> String {
    format!("causal_conv1d_step_{}", t.name())
}

/// The prefill conv's backward (dx and the partial sums of dweight and dbias).
pub fn causal_conv1d_bwd(t: Ty, taps: ConvTaps) -> String {
    format!("causal_conv1d_bwd_{}_{}", t.name(), taps.name())
}

/// Channels per thread of the conv's `_lanes` kernels (widths up to 4): the prefill's (8 would
/// take 214 registers a thread, an eighth of the SM's threads).
pub const CONV_LANES: [usize; 2] = [2, 4];
/// The backward's (each channel holds five windows in registers).
pub const CONV_BWD_LANES: [usize; 1] = [2];

/// Whether `lanes` channels of `t` make one load (at most 16 bytes).
pub const fn conv_lanes_fit(t: Ty, lanes: usize) -> bool {
    lanes * t.bytes() <= 16
}

/// The prefill conv with `lanes` channels per thread.
pub fn causal_conv1d_lanes(t: Ty, lanes: usize) -> String {
    format!("causal_conv1d_{}_v{lanes}", t.name())
}

/// The prefill conv's backward with `lanes` channels per thread.
pub fn causal_conv1d_bwd_lanes(t: Ty, lanes: usize) -> String {
    format!("causal_conv1d_bwd_{}_k4_v{lanes}", t.name())
}

pub fn gated_rms_norm(t: Ty, kind: RowKind) -> String {
    format!("gated_rms_norm_{}_{}", t.name(), kind.name())
}

/// Residual add + RMSNorm with an f32 residual (`res_f32`) or one of the value type.
pub fn add_rms_norm(t: Ty, res_f32: bool, kind: RowKind) -> String {
    let res = if res_f32 { "res_f32" } else { "res_same" };
    format!("add_rms_norm_{}_{res}_{}", t.name(), kind.name())
}

/// The row kinds of the norms' backward kernels (strided values in registers, or re-read).
pub const NORM_BWD_ROWS: [RowKind; 2] = [RowKind::Reg, RowKind::Loop];

/// The gated norm's backward (dx, dz and the partial sums of dweight).
pub fn gated_rms_norm_bwd(t: Ty, kind: RowKind) -> String {
    format!("gated_rms_norm_bwd_{}_{}", t.name(), kind.name())
}

/// The RMSNorm's backward (add_rms_norm's recorded half: dv and the partial sums of dweight).
pub fn rms_norm_bwd(t: Ty, kind: RowKind) -> String {
    format!("rms_norm_bwd_{}_{}", t.name(), kind.name())
}

/// The add norm's backward along the residual stream (the carried gradient plus d sum, in the
/// residual's type and rounded to the values' type, and the partial sums of dweight).
pub fn add_norm_bwd(t: Ty, r: Ty, kind: RowKind) -> String {
    format!("add_norm_bwd_{}_{}_{}", t.name(), r.name(), kind.name())
}

/// The types of target ids the loss kernels read: their suffix in kernel names and C type.
pub const IDS: [(&str, &str); 2] = [("u32", "uint32_t"), ("i64", "int64_t")];

/// The cross-entropy's forward: each row's NLL.
pub fn nll_rows(t: Ty, ids: &str) -> String {
    format!("nll_rows_{}_{ids}", t.name())
}

/// The cross-entropy's backward: the logits' gradient.
pub fn dlogits(t: Ty, ids: &str) -> String {
    format!("dlogits_{}_{ids}", t.name())
}

/// The embedding's backward (a scatter-add into f32 rows).
pub fn embedding_bwd(t: Ty) -> String {
    format!("embedding_bwd_{}", t.name())
}

/// matvec with `rows` × `cols` per program, 16-byte loads (`vec`) or scalar ones.
pub fn matvec(t: Ty, rows: usize, cols: usize, vec: bool) -> String {
    let kind = if vec { "vec" } else { "scalar" };
    format!("matvec_{}_r{rows}_c{cols}_{kind}", t.name())
}

/// The words scatter_rows moves a row in: (bytes, C type), widest first.
pub const ROW_WORDS: [(usize, &str); 4] = [
    (16, "uint4"),
    (8, "uint2"),
    (4, "uint32_t"),
    (2, "uint16_t"),
];

/// scatter_rows moving rows in words of `bytes`.
pub fn scatter_rows(bytes: usize) -> String {
    format!("scatter_rows_w{bytes}")
}

/// One kernel: the `.cu` file that defines it (under `kernels/`, without extension), its name,
/// and the macro call in that file that instantiates it.
#[derive(Clone, Debug)]
pub struct Instance {
    pub file: &'static str,
    pub name: String,
    pub call: String,
}

fn add(list: &mut Vec<Instance>, file: &'static str, name: String, mac: &str, args: &[&str]) {
    let call = format!("{mac}({name}, {})", args.join(", "));
    list.push(Instance { file, name, call });
}

/// Every kernel of every `.cu` file.
pub fn instances() -> Vec<Instance> {
    let mut v = Vec::new();
    for (bytes, word) in ROW_WORDS {
        add(
            &mut v,
            "rows/rows",
            scatter_rows(bytes),
            "SCATTER_ROWS",
            &[word],
        );
    }
    for t in VALUES {
        add(
            &mut v,
            "ssd/chunk_cumsum",
            chunk_cumsum(t),
            "CHUNK_CUMSUM",
            &[t.c()],
        );
        add(
            &mut v,
            "ssd/bwd_chunk_cumsum",
            bwd_chunk_cumsum(t),
            "BWD_CHUNK_CUMSUM",
            &[t.c()],
        );
        for s in STATES {
            let args = [t.c(), s.c()];
            let name = bwd_chunk_state(t, s);
            add(&mut v, "ssd/bwd_pass_state", name, "BWD_CHUNK_STATE", &args);
            let name = bwd_compute_out(t, s, None);
            add(
                &mut v,
                "ssd/bwd_compute_out",
                name,
                "BWD_COMPUTE_OUT",
                &args,
            );
            let name = fwd_pass_state_simt(t, s);
            add(
                &mut v,
                "ssd/fwd_pass_state",
                name,
                "FPS_SIMT",
                &[t.c(), s.c()],
            );
            let name = compute_out_simt(t, s);
            add(&mut v, "ssd/compute_out", name, "CO_SIMT", &[t.c(), s.c()]);
            for path in StepPath::ALL {
                let name = ssd_step(t, s, path);
                let (mac, rows) = match path {
                    StepPath::Vec1 => ("STEP_VEC", "1"),
                    StepPath::Vec2 => ("STEP_VEC", "2"),
                    StepPath::Scalar => ("STEP_SCALAR", ""),
                };
                let args = [t.c(), s.c(), rows];
                let args = if rows.is_empty() {
                    &args[..2]
                } else {
                    &args[..]
                };
                add(&mut v, "ssd_step/ssd_step", name, mac, args);
            }
        }
        add(
            &mut v,
            "conv/causal_conv1d",
            causal_conv1d(t),
            "CONV",
            &[t.c()],
        );
        let name = causal_conv1d_step(t);
        add(&mut v, "conv/causal_conv1d", name, "CONV_STEP", &[t.c()]);
        for taps in ConvTaps::ALL {
            let name = causal_conv1d_bwd(t, taps);
            let w = taps.window().to_string();
            add(&mut v, "conv/causal_conv1d", name, "CONV_BWD", &[t.c(), &w]);
        }
        for lanes in CONV_LANES.into_iter().filter(|&n| conv_lanes_fit(t, n)) {
            let (name, n) = (causal_conv1d_lanes(t, lanes), lanes.to_string());
            add(
                &mut v,
                "conv/causal_conv1d",
                name,
                "CONV_LANES",
                &[t.c(), &n],
            );
        }
        for lanes in CONV_BWD_LANES.into_iter().filter(|&n| conv_lanes_fit(t, n)) {
            let (name, n) = (causal_conv1d_bwd_lanes(t, lanes), lanes.to_string());
            add(
                &mut v,
                "conv/causal_conv1d",
                name,
                "CONV_BWD_LANES",
                &[t.c(), &n],
            );
        }
        for kind in NORM_BWD_ROWS {
            let rows = if kind == RowKind::Reg { "8" } else { "0" };
            let name = gated_rms_norm_bwd(t, kind);
            add(
                &mut v,
                "norm/rms_norm",
                name,
                "GATED_NORM_BWD",
                &[t.c(), rows],
            );
            let name = rms_norm_bwd(t, kind);
            add(
                &mut v,
                "norm/rms_norm",
                name,
                "RMS_NORM_BWD",
                &[t.c(), rows],
            );
            let name = add_norm_bwd(t, Ty::F32, kind);
            let args = [t.c(), Ty::F32.c(), rows];
            add(&mut v, "norm/rms_norm", name, "ADD_NORM_BWD", &args);
        }
        for kind in RowKind::ALL {
            let (gated, add_norm, rows) = match kind {
                RowKind::Vec => ("GATED_NORM_VEC", "ADD_NORM_VEC", ""),
                RowKind::Reg => ("GATED_NORM", "ADD_NORM", "8"),
                RowKind::Loop => ("GATED_NORM", "ADD_NORM", "0"),
            };
            let with_rows = |first: &[&'static str]| {
                let mut a = first.to_vec();
                if !rows.is_empty() {
                    a.push(rows);
                }
                a
            };
            let name = gated_rms_norm(t, kind);
            add(&mut v, "norm/rms_norm", name, gated, &with_rows(&[t.c()]));
            for (res_f32, r) in [(true, Ty::F32.c()), (false, t.c())] {
                let name = add_rms_norm(t, res_f32, kind);
                add(
                    &mut v,
                    "norm/rms_norm",
                    name,
                    add_norm,
                    &with_rows(&[t.c(), r]),
                );
            }
        }
        let name = embedding_bwd(t);
        add(
            &mut v,
            "embedding/embedding",
            name,
            "EMBEDDING_BWD",
            &[t.c()],
        );
        for (ids, c) in IDS {
            let args = [t.c(), c];
            add(
                &mut v,
                "loss/cross_entropy",
                nll_rows(t, ids),
                "NLL_ROWS",
                &args,
            );
            add(
                &mut v,
                "loss/cross_entropy",
                dlogits(t, ids),
                "DLOGITS",
                &args,
            );
        }
        for (rows, cols) in MATVEC_TILES {
            let (r, c) = (rows.to_string(), cols.to_string());
            for vec in [true, false] {
                let args = [t.c(), &r, &c, if vec { "true" } else { "false" }];
                add(
                    &mut v,
                    "matvec/matvec",
                    matvec(t, rows, cols, vec),
                    "MATVEC",
                    &args,
                );
            }
        }
    }
    for s in STATES {
        for wide in [false, true] {
            add(
                &mut v,
                "ssd/bwd_pass_state",
                bwd_state_scan(wide, s),
                "BWD_STATE_SCAN",
                &[s.c(), if wide { "true" } else { "false" }],
            );
        }
        for deep in [false, true] {
            // Chunks of 8 states in flight per thread: 128 bytes, 256 in the deep ring.
            let per = (if deep { 256 } else { 128 } / (8 * s.bytes())).to_string();
            for packed in PACKED {
                let args = [s.c(), &per, flag(packed)];
                add(
                    &mut v,
                    "ssd/fwd_pass_state",
                    state_scan(deep, packed, s),
                    "SCAN",
                    &args,
                );
            }
        }
    }
    for t in MMA_VALUES {
        let name = bwd_compute_out_round(t);
        add(
            &mut v,
            "ssd/bwd_compute_out",
            name,
            "BWD_COMPUTE_OUT_ROUND",
            &[t.c()],
        );
        for s in STATES {
            for w in CHUNK_STATE_WARPS {
                for nt in CHUNK_STATE_TILES {
                    let (ws, ns) = (w.to_string(), nt.to_string());
                    for (form, packed) in ChunkStateForm::ALL
                        .iter()
                        .flat_map(|&f| PACKED.map(|p| (f, p)))
                    {
                        let name = chunk_state_mma(form, packed, t, s, w, nt);
                        let args = [t.c(), s.c(), &ws, &ns, flag(packed)];
                        add(&mut v, "ssd/fwd_pass_state", name, form.mac(), &args);
                    }
                }
            }
            for (p, n) in BWD_COMPUTE_OUT_FIXED {
                let (ps, ns) = (p.to_string(), n.to_string());
                let name = bwd_compute_out(t, s, Some((p, n)));
                add(
                    &mut v,
                    "ssd/bwd_compute_out",
                    name,
                    "BWD_COMPUTE_OUT_FIXED",
                    &[t.c(), s.c(), &ps, &ns],
                );
            }
            for (n, pt) in COMPUTE_OUT_TILES {
                let (ns, ps) = (n.to_string(), pt.to_string());
                for packed in PACKED {
                    let name = compute_out_mma(false, packed, t, s, n, pt);
                    let args = [t.c(), s.c(), &ns, &ps, flag(packed)];
                    add(&mut v, "ssd/compute_out", name, "CO_MMA", &args);
                }
            }
        }
    }
    for (_, n) in BWD_COMPUTE_OUT_FIXED {
        for (s, mac) in [
            (Ty::Bf16, "BWD_COMPUTE_OUT_TMA"),
            (Ty::F32, "BWD_COMPUTE_OUT_TMA_F32"),
        ] {
            for bc in [true, false]
                .into_iter()
                .filter(|&bc| bc || BWD_BC_DSTATES.contains(&n))
            {
                let name = bwd_compute_out_tma(s, n, bc);
                let args = [n.to_string(), bc.to_string()];
                add(
                    &mut v,
                    "ssd/bwd_compute_out",
                    name,
                    mac,
                    &[&args[0], &args[1]],
                );
            }
        }
    }
    for n in BWD_BC_DSTATES {
        for s in [Ty::Bf16, Ty::F32] {
            add(
                &mut v,
                "ssd/bwd_bc",
                bwd_bc(s, n),
                "BWD_BC",
                &[s.c(), &n.to_string()],
            );
        }
    }
    for t in COMPUTE_OUT_TMA_VALUES {
        for (n, pt) in COMPUTE_OUT_TILES {
            let (ns, ps) = (n.to_string(), pt.to_string());
            for packed in PACKED {
                let name = compute_out_mma(true, packed, t, t, n, pt);
                let args = [t.c(), &ns, &ps, flag(packed)];
                add(&mut v, "ssd/compute_out", name, "CO_MMA_TMA", &args);
            }
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn kernel_names_are_unique_and_files_known() {
        let all = instances();
        let names: HashSet<&str> = all.iter().map(|k| k.name.as_str()).collect();
        assert_eq!(names.len(), all.len());
        let files: HashSet<&str> = all.iter().map(|k| k.file).collect();
        let want = [
            "ssd/chunk_cumsum",
            "ssd/fwd_pass_state",
            "ssd/compute_out",
            "ssd/bwd_chunk_cumsum",
            "ssd/bwd_pass_state",
            "ssd/bwd_compute_out",
            "ssd/bwd_bc",
            "ssd_step/ssd_step",
            "conv/causal_conv1d",
            "norm/rms_norm",
            "matvec/matvec",
            "loss/cross_entropy",
            "embedding/embedding",
            "rows/rows",
        ];
        assert_eq!(files, want.into_iter().collect());
    }

    #[test]
    fn every_bwd_bc_kernel_has_its_bwd_compute_out_form() {
        let names: HashSet<String> = instances().into_iter().map(|k| k.name).collect();
        for n in BWD_BC_DSTATES {
            assert!(BWD_COMPUTE_OUT_FIXED.contains(&(64, n)), "N = {n}");
            for s in [Ty::Bf16, Ty::F32] {
                assert!(names.contains(&bwd_bc(s, n)), "{s:?} {n}");
                assert!(
                    names.contains(&bwd_compute_out_tma(s, n, false)),
                    "{s:?} {n}"
                );
            }
        }
    }

    #[test]
    fn every_loss_and_embedding_kernel_is_instantiated() {
        let names: HashSet<String> = instances().into_iter().map(|k| k.name).collect();
        for t in VALUES {
            assert!(names.contains(&embedding_bwd(t)), "{t:?}");
            for (ids, _) in IDS {
                assert!(names.contains(&nll_rows(t, ids)), "{t:?} {ids}");
                assert!(names.contains(&dlogits(t, ids)), "{t:?} {ids}");
            }
        }
    }

    #[test]
    fn calls_name_their_kernel_first() {
        let call = &instances()
            .into_iter()
            .find(|k| k.name == "compute_out_mma_bf16_f32_n128_p64")
            .expect("an instance")
            .call;
        assert_eq!(
            call,
            "CO_MMA(compute_out_mma_bf16_f32_n128_p64, __nv_bfloat16, float, 128, 64, false)"
        );
        let scan = instances()
            .into_iter()
            .find(|k| k.name == "state_scan_deep_bf16")
            .expect("an instance");
        assert_eq!(
            scan.call,
            "SCAN(state_scan_deep_bf16, __nv_bfloat16, 16, false)"
        );
        let scan = instances()
            .into_iter()
            .find(|k| k.name == "state_scan_f32")
            .expect("an instance");
        assert_eq!(scan.call, "SCAN(state_scan_f32, float, 4, false)");
    }
}
