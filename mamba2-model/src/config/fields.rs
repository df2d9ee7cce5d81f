//! Reading a `config.json` object: typed access to its keys with errors that name the key, and
//! the non-finite floats that Python's json module and transformers write.

use candle_core::{bail, Result};
use serde_json::{Map, Value};

/// Rewrites the bare `Infinity`, `-Infinity` and `NaN` tokens that Python's json module writes
/// (outside string literals) as transformers 5's `{"__float__": "..."}` objects, so that the text
/// becomes JSON.
pub(super) fn quote_bare_floats(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    let mut in_string = false;
    while let Some(c) = rest.chars().next() {
        if in_string {
            if c == '\\' {
                let skip: usize = rest.chars().take(2).map(char::len_utf8).sum();
                out.push_str(&rest[..skip]);
                rest = &rest[skip..];
                continue;
            }
            in_string = c != '"';
        } else if c == '"' {
            in_string = true;
        } else if let Some(word) = ["-Infinity", "Infinity", "NaN"]
            .into_iter()
            .find(|w| rest.starts_with(w))
        {
            out.push_str(&format!("{{\"__float__\": \"{word}\"}}"));
            rest = &rest[word.len()..];
            continue;
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

/// Typed access to the keys of one JSON object, with errors that name the key.
pub(super) struct Fields<'a> {
    obj: &'a Map<String, Value>,
    prefix: &'a str,
}

impl<'a> Fields<'a> {
    pub(super) fn new(obj: &'a Map<String, Value>, prefix: &'a str) -> Self {
        Self { obj, prefix }
    }

    /// The value of `key`, `None` when absent or null.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn bad<T>(&self, key: &str, want: &str, v: &Value) -> Result<T> {
        bail!("{}{key} must be {want}, got {v}", self.prefix)
    }

    /// Errors on the first key outside `known`.
    pub(super) fn only(&self, known: &[&str]) -> Result<()> {
        match self.obj.keys().find(|k| !known.contains(&k.as_str())) {
            Some(k) => bail!(
                "unknown key {}{k} (known keys: {})",
                self.prefix,
                known.join(", ")
            ),
            None => Ok(()),
        }
    }

    pub(super) fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_u64().and_then(|n| usize::try_from(n).ok()) {
                Some(n) => Ok(Some(n)),
                None => self.bad(key, "a non-negative integer", v),
            },
        }
    }

    pub(super) fn usize(&self, key: &str, default: usize) -> Result<usize> {
        Ok(self.opt_usize(key)?.unwrap_or(default))
    }

    pub(super) fn bool(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => self.bad(key, "true or false", v),
        }
    }

    pub(super) fn float(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => match special_float(v) {
                Some(x) => Ok(x),
                None => self.bad(key, "a number", v),
            },
        }
    }

    pub(super) fn string(&self, key: &str, default: Option<&str>) -> Result<String> {
        match (self.get(key), default) {
            (Some(Value::String(s)), _) => Ok(s.clone()),
            (None, Some(d)) => Ok(d.to_string()),
            (None, None) => bail!("{}{key} is missing", self.prefix),
            (Some(v), _) => self.bad(key, "a string", v),
        }
    }

    pub(super) fn list_is_empty(&self, key: &str) -> Result<bool> {
        match self.get(key) {
            None => Ok(true),
            Some(Value::Array(a)) => Ok(a.is_empty()),
            Some(v) => self.bad(key, "a list", v),
        }
    }

    /// A `[lo, hi]` pair of numbers (either bound possibly infinite); `(0, ∞)` when absent.
    pub(super) fn limit(&self, key: &str) -> Result<(f32, f32)> {
        let Some(v) = self.get(key) else {
            return Ok((0.0, f32::INFINITY));
        };
        match v
            .as_array()
            .map(|a| a.iter().map(special_float).collect::<Vec<_>>())
        {
            Some(pair) => match pair.as_slice() {
                [Some(lo), Some(hi)] => Ok((*lo as f32, *hi as f32)),
                _ => self.bad(key, "a pair [lo, hi] of numbers", v),
            },
            None => self.bad(key, "a pair [lo, hi] of numbers", v),
        }
    }

    /// A token id or a list of token ids.
    pub(super) fn token_ids(&self, key: &str, default: &[u32]) -> Result<Vec<u32>> {
        let id = |v: &Value| v.as_u64().and_then(|n| u32::try_from(n).ok());
        match self.get(key) {
            None if self.obj.contains_key(key) => Ok(Vec::new()),
            None => Ok(default.to_vec()),
            Some(Value::Array(a)) => match a.iter().map(id).collect::<Option<Vec<_>>>() {
                Some(ids) => Ok(ids),
                None => self.bad(
                    key,
                    "a token id or a list of token ids",
                    &Value::Array(a.clone()),
                ),
            },
            Some(v) => match id(v) {
                Some(i) => Ok(vec![i]),
                None => self.bad(key, "a token id or a list of token ids", v),
            },
        }
    }
}

/// A JSON number, or transformers' `{"__float__": "Infinity" | "-Infinity" | "NaN"}`.
pub(super) fn special_float(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::Object(m) if m.len() == 1 => match m.get("__float__")?.as_str()? {
            "Infinity" => Some(f64::INFINITY),
            "-Infinity" => Some(f64::NEG_INFINITY),
            "NaN" => Some(f64::NAN),
            _ => None,
        },
        _ => None,
    }
}
