// chat: template source to syntax tree (internal to src/chat; template.h is the API).
#pragma once
#include <string>
#include <string_view>

#include "chat/ast.h"
#include "chat/template.h"

namespace dflash::chat {

// Throws TemplateError "NAME:LINE:COL: what" for a syntax error or an unsupported construct.
ast::Body parse_template(std::string_view source, const std::string& name, bool& has_generation);

}  // namespace dflash::chat
