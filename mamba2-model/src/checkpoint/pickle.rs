//! A pickle reader for `torch.save`'s `data.pkl`, of our own because candle's panics or aborts
//! on hostile input. It runs the ops of protocols 2 to 4 that a state dict is made of, shares
//! memoized objects instead of copying them, counts the copies a write to a shared container
//! makes and bounds nesting ([`Checkpoint::MAX_PICKLE_DEPTH`]), so that its memory stays
//! proportional to the pickle's size and dropping a result never overflows the stack.

use std::collections::HashMap;
use std::rc::Rc;

use candle_core::{bail, Result};

use super::Checkpoint;

/// Little-endian integers at `at` of `bytes`, `None` past the end.
fn le(bytes: &[u8], at: usize, n: usize) -> Option<u64> {
    let b = bytes.get(at..at.checked_add(n)?)?;
    Some(b.iter().rev().fold(0u64, |acc, &x| acc << 8 | u64::from(x)))
}

/// A pickle object, the subset torch state dicts are made of. Children are shared (`Rc`), and a
/// shared container is copied before a write, so memo lookups cost nothing and copies are counted.
#[derive(Clone)]
pub(super) enum Value {
    Int(i64),
    Str(String),
    Global(String, String),
    Tuple(Vec<Rc<Node>>),
    List(Vec<Rc<Node>>),
    Dict(Vec<(Rc<Node>, Rc<Node>)>),
    Reduce(Rc<Node>, Rc<Node>),
    PersId(Rc<Node>),
    /// None, booleans, floats and objects that a state dict's tensors never need.
    Other,
}

/// A pickle object and its nesting depth (1 for a leaf).
#[derive(Clone)]
pub(super) struct Node {
    depth: usize,
    pub(super) value: Value,
}

impl Node {
    pub(super) fn global(&self) -> Option<(&str, &str)> {
        match &self.value {
            Value::Global(m, c) => Some((m, c)),
            _ => None,
        }
    }

    pub(super) fn tuple(&self) -> Option<&[Rc<Node>]> {
        match &self.value {
            Value::Tuple(items) => Some(items),
            _ => None,
        }
    }

    /// A non-negative integer that fits `usize`; `what` names it in errors.
    pub(super) fn index(&self, what: &str) -> Result<usize> {
        match &self.value {
            Value::Int(i) => usize::try_from(*i).map_err(|_| {
                candle_core::Error::msg(format!("{what} {i} is negative or too large"))
            }),
            _ => bail!("{what} is not an integer"),
        }
    }
}

/// A stack slot: an object or a MARK.
enum Slot {
    Mark,
    Obj(Rc<Node>),
}

/// The pickle machine: the stack, the memo and the copies made so far.
struct Machine {
    stack: Vec<Slot>,
    memo: HashMap<u32, Rc<Node>>,
    copied: usize,
    copy_budget: usize,
}

impl Machine {
    fn node(&self, value: Value) -> Result<Rc<Node>> {
        let children: Box<dyn Iterator<Item = &Rc<Node>>> = match &value {
            Value::Tuple(v) | Value::List(v) => Box::new(v.iter()),
            Value::Dict(v) => Box::new(v.iter().flat_map(|(k, v)| [k, v])),
            Value::Reduce(a, b) => Box::new([a, b].into_iter()),
            Value::PersId(a) => Box::new(std::iter::once(a)),
            _ => Box::new(std::iter::empty()),
        };
        let depth = 1 + children.map(|c| c.depth).max().unwrap_or(0);
        if depth > Checkpoint::MAX_PICKLE_DEPTH {
            bail!(
                "pickle objects nest deeper than {}",
                Checkpoint::MAX_PICKLE_DEPTH
            )
        }
        Ok(Rc::new(Node { depth, value }))
    }

    fn push(&mut self, value: Value) -> Result<()> {
        let node = self.node(value)?;
        self.stack.push(Slot::Obj(node));
        Ok(())
    }

    fn pop(&mut self) -> Result<Rc<Node>> {
        match self.stack.pop() {
            Some(Slot::Obj(o)) => Ok(o),
            Some(Slot::Mark) => bail!("pickle pops a MARK as an object"),
            None => bail!("pickle pops an empty stack"),
        }
    }

    fn top(&self) -> Result<&Rc<Node>> {
        match self.stack.last() {
            Some(Slot::Obj(o)) => Ok(o),
            _ => bail!("pickle reads a missing object"),
        }
    }

    /// The objects above the topmost MARK, which is removed.
    fn pop_to_mark(&mut self) -> Result<Vec<Rc<Node>>> {
        let Some(mark) = self.stack.iter().rposition(|s| matches!(s, Slot::Mark)) else {
            bail!("pickle has no MARK to pop to")
        };
        let items = self.stack.split_off(mark + 1);
        self.stack.pop();
        items
            .into_iter()
            .map(|s| match s {
                Slot::Obj(o) => Ok(o),
                Slot::Mark => bail!("pickle has a MARK among items"),
            })
            .collect()
    }

    /// Adds `items` to the list (`pairs` false) or dict on top of the stack, copying it first if
    /// it is shared, within the copy budget.
    fn extend(&mut self, items: Vec<Rc<Node>>, pairs: bool) -> Result<()> {
        let budget = self.copy_budget;
        let Some(Slot::Obj(top)) = self.stack.last_mut() else {
            bail!("pickle adds items to a missing object")
        };
        let len = match (&top.value, pairs) {
            (Value::List(v), false) => v.len(),
            (Value::Dict(v), true) if items.len() % 2 == 0 => v.len(),
            _ => bail!("pickle adds items to an object that is not a list or dict, or a key alone"),
        };
        if Rc::strong_count(top) > 1 {
            self.copied += len;
            if self.copied > budget {
                bail!("pickle copies more than {budget} objects (a memo bomb?)")
            }
        }
        let deepest = items.iter().map(|i| i.depth).max().unwrap_or(0);
        let node = Rc::make_mut(top);
        match &mut node.value {
            Value::List(v) => v.extend(items),
            Value::Dict(v) => {
                let mut it = items.into_iter();
                while let (Some(k), Some(x)) = (it.next(), it.next()) {
                    v.push((k, x));
                }
            }
            _ => bail!("pickle adds items to an object that is not a list or dict"),
        }
        node.depth = node.depth.max(deepest + 1);
        if node.depth > Checkpoint::MAX_PICKLE_DEPTH {
            bail!(
                "pickle objects nest deeper than {}",
                Checkpoint::MAX_PICKLE_DEPTH
            )
        }
        Ok(())
    }

    fn memo_put(&mut self, id: u32) -> Result<()> {
        let top = self.top()?.clone();
        self.memo.insert(id, top);
        Ok(())
    }

    fn memo_get(&mut self, id: u32) -> Result<()> {
        let Some(o) = self.memo.get(&id) else {
            bail!("pickle reads memo {id}, which was never written")
        };
        self.stack.push(Slot::Obj(o.clone()));
        Ok(())
    }
}

/// The bytes of a pickle, read op by op.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        match self
            .at
            .checked_add(n)
            .and_then(|end| self.bytes.get(self.at..end))
        {
            Some(b) => {
                self.at += n;
                Ok(b)
            }
            None => bail!("pickle ends inside an op at byte {}", self.at),
        }
    }

    fn int(&mut self, n: usize) -> Result<u64> {
        let b = self.take(n)?;
        Ok(le(b, 0, n).unwrap_or(0))
    }

    fn line(&mut self) -> Result<String> {
        let rest = &self.bytes[self.at..];
        let Some(end) = rest.iter().position(|&b| b == b'\n') else {
            bail!("pickle ends inside a GLOBAL at byte {}", self.at)
        };
        self.at += end + 1;
        Ok(String::from_utf8_lossy(&rest[..end]).into_owned())
    }

    fn string(&mut self, n: usize) -> Result<Value> {
        match std::str::from_utf8(self.take(n)?) {
            Ok(s) => Ok(Value::Str(s.to_string())),
            Err(_) => bail!("pickle string before byte {} is not UTF-8", self.at),
        }
    }
}

/// Runs the pickle `bytes` and returns the object it builds. Supports the ops of protocols 2 to 4
/// that `torch.save` writes; memory stays proportional to `bytes.len()`.
pub(super) fn unpickle(bytes: &[u8]) -> Result<Rc<Node>> {
    let mut m = Machine {
        stack: Vec::new(),
        memo: HashMap::new(),
        copied: 0,
        copy_budget: bytes.len(),
    };
    let mut r = Reader { bytes, at: 0 };
    loop {
        let op = r.take(1)?[0];
        match op {
            0x80 => {
                r.take(1)?;
            }
            0x95 => {
                r.take(8)?;
            }
            b'.' => break,
            b'(' => m.stack.push(Slot::Mark),
            b')' => m.push(Value::Tuple(Vec::new()))?,
            b']' => m.push(Value::List(Vec::new()))?,
            b'}' => m.push(Value::Dict(Vec::new()))?,
            b'N' | 0x88 | 0x89 => m.push(Value::Other)?,
            b'G' => {
                r.take(8)?;
                m.push(Value::Other)?
            }
            b'K' => m.push(Value::Int(r.int(1)? as i64))?,
            b'M' => m.push(Value::Int(r.int(2)? as i64))?,
            b'J' => m.push(Value::Int(i64::from(r.int(4)? as u32 as i32)))?,
            0x8a => {
                let n = r.int(1)? as usize;
                if n > 8 {
                    bail!("pickle integer of {n} bytes (at most 8 are read)")
                }
                let v = r.int(n)?;
                // Two's complement of n bytes, sign-extended.
                let shift = 64 - 8 * n as u32;
                let v = if n == 0 {
                    0
                } else {
                    ((v << shift) as i64) >> shift
                };
                m.push(Value::Int(v))?
            }
            b'X' => {
                let n = r.int(4)? as usize;
                let s = r.string(n)?;
                m.push(s)?
            }
            0x8c => {
                let n = r.int(1)? as usize;
                let s = r.string(n)?;
                m.push(s)?
            }
            b'c' => {
                let (module, class) = (r.line()?, r.line()?);
                m.push(Value::Global(module, class))?
            }
            0x93 => {
                let (class, module) = (m.pop()?, m.pop()?);
                let (Value::Str(module), Value::Str(class)) = (&module.value, &class.value) else {
                    bail!("pickle STACK_GLOBAL of non-strings")
                };
                m.push(Value::Global(module.clone(), class.clone()))?
            }
            b't' => {
                let items = m.pop_to_mark()?;
                m.push(Value::Tuple(items))?
            }
            0x85..=0x87 => {
                let n = usize::from(op - 0x84);
                let mut items = (0..n).map(|_| m.pop()).collect::<Result<Vec<_>>>()?;
                items.reverse();
                m.push(Value::Tuple(items))?
            }
            b'd' => {
                let items = m.pop_to_mark()?;
                m.push(Value::Dict(Vec::new()))?;
                m.extend(items, true)?
            }
            b'a' => {
                let item = m.pop()?;
                m.extend(vec![item], false)?
            }
            b'e' => {
                let items = m.pop_to_mark()?;
                m.extend(items, false)?
            }
            b's' => {
                let (v, k) = (m.pop()?, m.pop()?);
                m.extend(vec![k, v], true)?
            }
            b'u' => {
                let items = m.pop_to_mark()?;
                m.extend(items, true)?
            }
            b'R' | 0x81 => {
                let (args, f) = (m.pop()?, m.pop()?);
                if f.global() == Some(("collections", "OrderedDict")) {
                    m.push(Value::Dict(Vec::new()))?
                } else {
                    m.push(Value::Reduce(f, args))?
                }
            }
            // BUILD sets an object's state: tensors and state dicts need none of it.
            b'b' => {
                m.pop()?;
                m.top()?;
            }
            b'Q' => {
                let id = m.pop()?;
                m.push(Value::PersId(id))?
            }
            b'q' => m.memo_put(r.int(1)? as u32)?,
            b'r' => m.memo_put(r.int(4)? as u32)?,
            0x94 => m.memo_put(m.memo.len() as u32)?,
            b'h' => m.memo_get(r.int(1)? as u32)?,
            b'j' => m.memo_get(r.int(4)? as u32)?,
            op => bail!("unsupported pickle op 0x{op:02x} at byte {}", r.at - 1),
        }
    }
    m.pop()
}
