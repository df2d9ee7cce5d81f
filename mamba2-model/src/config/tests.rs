//! Unit tests of config parsing, derived sizes and validation.

use serde_json::json;

use super::fields::{quote_bare_floats, special_float};
use super::*;
/// An HF config of 2 heads of 64 on d_model 64, with `extra` keys (each preceded by a comma).
fn hf(extra: &str) -> Result<Config> {
    Config::from_json(&format!(
        r#"{{"hidden_size": 64, "num_heads": 2, "n_groups": 1{extra}}}"#
    ))
}

#[test]
fn derived_sizes_follow_the_projection_layout() -> Result<()> {
    // (config, d_inner, conv_dim, in_proj_dim, norm_group_size): the shipped model's sizes,
    // then transformers' defaults (8 groups of 128 states).
    let shipped = r#"{"hidden_size": 384, "num_heads": 12, "head_dim": 64, "state_size": 64,
                          "n_groups": 1}"#;
    for (text, d_inner, conv_dim, in_proj, group) in [
        (shipped, 768, 896, 1676, 768),
        (r#"{"hidden_size": 4096}"#, 8192, 10240, 18560, 1024),
    ] {
        let c = Config::from_json(text)?;
        assert_eq!((c.d_inner(), c.conv_dim()), (d_inner, conv_dim));
        assert_eq!((c.in_proj_dim(), c.norm_group_size()), (in_proj, group));
        assert_eq!(c.d_inner(), c.expand * c.d_model);
        assert_eq!(c.norm_group_size() * c.ngroups, c.d_inner());
        // z | x B C | dt.
        let gn = c.ngroups * c.d_state;
        assert_eq!(c.in_proj_dim(), 2 * c.d_inner() + 2 * gn + c.nheads);
    }
    Ok(())
}

#[test]
fn original_format_derives_nheads_and_pads_the_vocabulary() -> Result<()> {
    let original = |pad: usize| {
        Config::from_json(&format!(
            r#"{{"d_model": 96, "vocab_size": 1000, "pad_vocab_size_multiple": {pad},
                     "ssm_cfg": {{"layer": "Mamba2", "headdim": 32, "ngroups": 3}}}}"#
        ))
    };
    let c = original(16)?;
    // nheads = expand·d_model / headdim = 2·96 / 32.
    assert_eq!((c.nheads, c.ngroups, c.norm_group_size()), (6, 3, 64));
    assert_eq!(c.vocab_size, 1008);
    assert_eq!(original(1)?.vocab_size, 1000);
    assert_eq!(original(8)?.vocab_size, 1000);
    let err = original(0).map(|_| ()).unwrap_err().to_string();
    assert!(err.contains("pad_vocab_size_multiple must be >= 1"));
    Ok(())
}

#[test]
fn bare_non_finite_floats_are_quoted_outside_strings_only() {
    let text = r#"{"l": [-Infinity, Infinity], "n": NaN, "s": "Infinity \" NaN"}"#;
    let want = concat!(
        r#"{"l": [{"__float__": "-Infinity"}, {"__float__": "Infinity"}], "#,
        r#""n": {"__float__": "NaN"}, "s": "Infinity \" NaN"}"#
    );
    assert_eq!(quote_bare_floats(text), want);
    assert_eq!(quote_bare_floats(want), want);
}

#[test]
fn special_floats_are_numbers_or_one_tagged_key() {
    assert_eq!(special_float(&json!(1.5)), Some(1.5));
    assert_eq!(special_float(&json!(3)), Some(3.0));
    let tagged = |s: &str| special_float(&json!({ "__float__": s }));
    assert_eq!(tagged("Infinity"), Some(f64::INFINITY));
    assert_eq!(tagged("-Infinity"), Some(f64::NEG_INFINITY));
    assert!(tagged("NaN").is_some_and(f64::is_nan));
    assert_eq!(tagged("inf"), None);
    assert_eq!(special_float(&json!({"__float__": "NaN", "x": 1})), None);
    assert_eq!(special_float(&json!("1.0")), None);
}

#[test]
fn eos_token_id_is_one_id_a_list_or_null() -> Result<()> {
    assert_eq!(hf("")?.eos_token_ids, vec![2]);
    assert_eq!(hf(r#", "eos_token_id": 7"#)?.eos_token_ids, vec![7]);
    assert_eq!(hf(r#", "eos_token_id": [0, 9]"#)?.eos_token_ids, vec![0, 9]);
    assert!(hf(r#", "eos_token_id": null"#)?.eos_token_ids.is_empty());
    let err = hf(r#", "eos_token_id": -1"#).map(|_| ()).unwrap_err();
    assert!(err.to_string().contains("eos_token_id must be a token id"));
    Ok(())
}

#[test]
fn validate_names_zero_sizes_and_bad_values() -> Result<()> {
    let c = hf("")?;
    let refused = |edit: fn(&mut Config), needle: &str| {
        let mut bad = c.clone();
        edit(&mut bad);
        let err = bad.validate().map(|_| ()).unwrap_err().to_string();
        assert!(err.contains(needle), "{err:?} lacks {needle:?}");
    };
    refused(|c| c.d_state = 0, "state_size must be >= 1, got 0");
    refused(|c| c.ngroups = 0, "n_groups must be >= 1, got 0");
    refused(
        |c| c.norm_eps = 0.0,
        "layer_norm_epsilon must be finite, > 0 and <= 1, got 0",
    );
    refused(
        |c| c.dt_limit.0 = f32::NAN,
        "time_step_limit must be [lo, hi] with lo finite and >= 0",
    );
    c.validate()
}

#[test]
fn derived_sizes_never_wrap() -> Result<()> {
    // half·half wraps to 0 in usize: both products would pass a wrapping equality check.
    let half = 1usize << (usize::BITS / 2);
    let huge = Config {
        d_model: half,
        expand: half,
        nheads: half,
        headdim: half,
        ..hf("")?
    };
    assert_eq!(huge.d_inner(), usize::MAX);
    assert_eq!(huge.in_proj_dim(), usize::MAX);
    let err = huge.validate().map(|_| ()).unwrap_err().to_string();
    assert!(err.contains(&format!(
        "hidden_size = {half} is above the limit of 1048576"
    )));
    // Each dimension in range, their product not.
    let wide = Config {
        d_model: 1 << 20,
        expand: 1 << 12,
        nheads: 1 << 16,
        headdim: 1 << 16,
        ..huge
    };
    let err = wide.validate().map(|_| ()).unwrap_err().to_string();
    assert!(err.contains("expand·hidden_size = 4096·1048576 = 4294967296 is above the limit"));
    Ok(())
}
