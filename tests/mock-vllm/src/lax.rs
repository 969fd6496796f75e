//! Pydantic-v2 lax-mode field coercion and the Python-repr error messages FastAPI
//! builds from validation errors. Messages are close approximations: a gateway
//! must match on status and envelope only.

use serde_json::{Map, Value};

use super::error::VllmError;

/// Reads fields of a JSON object the way pydantic's lax mode would, collecting errors.
pub(crate) struct Fields<'a> {
    body: &'a Map<String, Value>,
    errors: Vec<String>,
}

impl<'a> Fields<'a> {
    pub fn new(body: &'a Map<String, Value>) -> Self {
        Self {
            body,
            errors: Vec::new(),
        }
    }

    /// The raw value of a present, non-null field.
    pub fn raw(&self, key: &str) -> Option<&'a Value> {
        self.body.get(key).filter(|v| !v.is_null())
    }

    /// Record a failure for field `key`.
    pub fn fail(&mut self, key: &str, kind: &str, msg: &str, input: &Value) {
        self.errors.push(format!(
            "{{'type': '{kind}', 'loc': ('body', {}), 'msg': {}, 'input': {}}}",
            py_str(key),
            py_str(msg),
            py_repr(input)
        ));
    }

    /// Reject an explicit `null` for a non-optional field.
    fn null_check(&mut self, key: &str, kind: &str, msg: &str) {
        if self.body.get(key).is_some_and(Value::is_null) {
            self.fail(key, kind, msg, &Value::Null);
        }
    }

    pub fn int(&mut self, key: &str, nullable: bool) -> Option<i64> {
        if !nullable {
            self.null_check(key, "int_type", "Input should be a valid integer");
        }
        let value = self.raw(key)?;
        match lax_int(value) {
            Ok(i) => Some(i),
            Err((kind, msg)) => {
                self.fail(key, kind, msg, value);
                None
            }
        }
    }

    pub fn float(&mut self, key: &str, nullable: bool) -> Option<f64> {
        if !nullable {
            self.null_check(key, "float_type", "Input should be a valid number");
        }
        let value = self.raw(key)?;
        match value {
            Value::Number(n) => n.as_f64(),
            Value::Bool(b) => Some(f64::from(u8::from(*b))),
            Value::String(s) => s.trim().parse::<f64>().ok().or_else(|| {
                self.fail(
                    key,
                    "float_parsing",
                    "Input should be a valid number, unable to parse string as a number",
                    value,
                );
                None
            }),
            _ => {
                self.fail(key, "float_type", "Input should be a valid number", value);
                None
            }
        }
    }

    pub fn bool(&mut self, key: &str, nullable: bool) -> Option<bool> {
        if !nullable {
            self.null_check(key, "bool_type", "Input should be a valid boolean");
        }
        let value = self.raw(key)?;
        let parsed = match value {
            Value::Bool(b) => Some(*b),
            Value::Number(n) if n.as_f64() == Some(0.0) => Some(false),
            Value::Number(n) if n.as_f64() == Some(1.0) => Some(true),
            Value::String(s) => match s.to_ascii_lowercase().as_str() {
                "0" | "off" | "f" | "false" | "n" | "no" => Some(false),
                "1" | "on" | "t" | "true" | "y" | "yes" => Some(true),
                _ => None,
            },
            _ => None,
        };
        if parsed.is_none() {
            let (kind, msg) = match value {
                Value::Number(_) | Value::String(_) => (
                    "bool_parsing",
                    "Input should be a valid boolean, unable to interpret input",
                ),
                _ => ("bool_type", "Input should be a valid boolean"),
            };
            self.fail(key, kind, msg, value);
        }
        parsed
    }

    /// A string field (pydantic does not coerce numbers to strings).
    pub fn string(&mut self, key: &str) -> Option<String> {
        let value = self.raw(key)?;
        match value {
            Value::String(s) => Some(s.clone()),
            _ => {
                self.fail(key, "string_type", "Input should be a valid string", value);
                None
            }
        }
    }

    /// Turn the collected errors into the 400 "Bad Request" validation error, if any.
    pub fn finish(self) -> Result<(), VllmError> {
        if self.errors.is_empty() {
            Ok(())
        } else {
            Err(VllmError::validation(format!(
                "[{}]",
                self.errors.join(", ")
            )))
        }
    }
}

/// Pydantic's lax int: ints, integral floats, numeric strings and bools.
pub(crate) fn lax_int(value: &Value) -> Result<i64, (&'static str, &'static str)> {
    match value {
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                Ok(i)
            } else if n.is_u64() {
                Err((
                    "int_parsing",
                    "Input should be a valid integer, unable to parse number as an integer",
                ))
            } else {
                let f = n.as_f64().unwrap_or(f64::NAN);
                if f.fract() == 0.0 && f.abs() < 9.2e18 {
                    Ok(f as i64)
                } else {
                    Err((
                        "int_from_float",
                        "Input should be a valid integer, got a number with a fractional part",
                    ))
                }
            }
        }
        Value::Bool(b) => Ok(i64::from(*b)),
        Value::String(s) => s.trim().parse::<i64>().map_err(|_| {
            (
                "int_parsing",
                "Input should be a valid integer, unable to parse string as an integer",
            )
        }),
        _ => Err(("int_type", "Input should be a valid integer")),
    }
}

/// The error a `mode="before"` model validator raising `ValueError(msg)` produces.
pub(crate) fn value_error(msg: &str, input: &Value) -> VllmError {
    VllmError::validation(format!(
        "[{{'type': 'value_error', 'loc': ('body',), 'msg': {}, 'input': {}, 'ctx': {{'error': ValueError({})}}}}]",
        py_str(&format!("Value error, {msg}")),
        py_repr(input),
        py_str(msg)
    ))
}

/// Python truthiness of a raw JSON value (`data.get(key)` in a before-validator).
pub(crate) fn truthy(value: Option<&Value>) -> bool {
    match value {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(Value::Number(n)) => n.as_f64().is_some_and(|f| f != 0.0),
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
    }
}

/// Python `repr` of a JSON value as `json.loads` would have produced it.
pub(crate) fn py_repr(value: &Value) -> String {
    match value {
        Value::Null => "None".to_owned(),
        Value::Bool(true) => "True".to_owned(),
        Value::Bool(false) => "False".to_owned(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => py_str(s),
        Value::Array(items) => {
            let inner: Vec<String> = items.iter().map(py_repr).collect();
            format!("[{}]", inner.join(", "))
        }
        Value::Object(map) => {
            let inner: Vec<String> = map
                .iter()
                .map(|(k, v)| format!("{}: {}", py_str(k), py_repr(v)))
                .collect();
            format!("{{{}}}", inner.join(", "))
        }
    }
}

/// Python `repr` of a str: single quotes unless the text has `'` and no `"`.
pub(crate) fn py_str(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7F => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// Python's `str(float)`: always shows a fraction (`3.0`, not `3`).
pub(crate) fn py_float(x: f64) -> String {
    let s = x.to_string();
    if x.is_finite() && !s.contains(['.', 'e']) {
        format!("{s}.0")
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reprs() {
        let v: Value =
            serde_json::from_str(r#"{"a":[1,true,null,"it's"],"b":1.5}"#).unwrap_or_default();
        assert_eq!(py_repr(&v), r#"{'a': [1, True, None, "it's"], 'b': 1.5}"#);
        assert_eq!(py_float(3.0), "3.0");
        assert_eq!(py_float(-1.5), "-1.5");
    }
}
